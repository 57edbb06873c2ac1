"""The shared rules in interop/options.py."""


def test_default_chunk_rule():
    from interop.options import MIN_CHUNK_ROWS, default_chunk_rows

    assert MIN_CHUNK_ROWS == 64
    assert default_chunk_rows(16384, 4096, 128256) == 524  # L preset: 257 MiB of fp32 logits a chunk
    assert default_chunk_rows(2048, 64, 32768) == 64
    assert default_chunk_rows(100, 4096, 1000) == 100
