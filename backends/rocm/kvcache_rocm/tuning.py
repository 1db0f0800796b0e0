"""ROCm kernel tuning, as data. Differences from the CUDA table, and why:

* wavefront 64 (not warp 32): Triton's ``num_warps`` counts wavefronts on AMD, so the same
  thread count needs half the warps;
* 64 KiB LDS per CU (H100: 228 KiB shared memory per SM): smaller key tiles and one pipeline
  stage keep the prefill tiles resident;
* 304 CUs on an MI300X: split-K aims at one program per CU before splitting further.
These values are untested on AMD hardware (none is lent here); tests check that the ROCm backend
uses them.
"""

from kvcache_cuda.tuning import AttnTiles, Tuning

ROCM_TUNING = Tuning(
    prefill=AttnTiles(block_rows=64, block_n=32, num_warps=4, num_stages=1),
    decode=AttnTiles(block_rows=16, block_n=64, num_warps=2, num_stages=1),
    by_head_dim={
        64: {"prefill": AttnTiles(64, 64, 4, 1), "decode": AttnTiles(16, 64, 2, 1)},
        256: {"prefill": AttnTiles(32, 32, 4, 1), "decode": AttnTiles(16, 32, 2, 1)},
    },
    float32_by_head_dim={},          # the base tiles above already fit float32 in 64 KiB LDS
    split_programs_per_sm=1,
    elementwise_warps=2,
)
