"""Services the API layer owns itself (API keys and accounts)."""
