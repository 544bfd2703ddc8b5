"""OpenAI's Responses API: what Codex CLI speaks."""
