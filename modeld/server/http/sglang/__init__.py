"""The worker routes the SGLang model gateway reads."""
