"""The HTTP API: OpenAI's Chat Completions and Responses, Anthropic's Messages, Ollama's."""
