"""The shared rules of interop/options.py and interop/blocking.py."""


def test_default_chunk_rule():
    from interop.blocking import chunk_rows
    from interop.tuning import DEFAULT

    assert DEFAULT.min_chunk_rows == 64
    assert chunk_rows(DEFAULT, 16384, 4096, 128256) == 524  # L preset: 257 MiB of fp32 logits a chunk
    assert chunk_rows(DEFAULT, 2048, 64, 32768) == 64
    assert chunk_rows(DEFAULT, 100, 4096, 1000) == 100
