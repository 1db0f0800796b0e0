"""kvcache backend plugin cuda (work in progress)."""
