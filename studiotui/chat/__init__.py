"""Conversations: history in SQLite, documents and passages."""
