"""kvcache backend plugin rocm (work in progress)."""
