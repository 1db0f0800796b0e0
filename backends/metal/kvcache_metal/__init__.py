"""kvcache backend plugin metal (work in progress)."""
