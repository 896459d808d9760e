"""Start-up: the compilation cache, warm-up progress, background compiles of rare buckets, and
the quantized KV cache's calibration."""
