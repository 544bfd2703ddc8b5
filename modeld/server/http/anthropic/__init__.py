"""Anthropic's Messages API: what Claude Code speaks."""
