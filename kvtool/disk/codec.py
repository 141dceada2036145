"""Record codecs of a segment file (`KVToolConfig.ssd_codec`): each record stored as it is
(`none`) or compressed whole with `zstd` or `lz4` (`kvtool.disk.segment` has the file format).
"""

from __future__ import annotations

CODECS = ("none", "zstd", "lz4")
ZSTD_LEVEL = 3  # zstd's default; level 1 measured no faster on KV here (docs/design.md#segments-format-2-why-and-what)


class CodecError(Exception):
    """A compressed record that does not decode to its declared size."""


def compress(codec: str, data: bytes | memoryview) -> bytes:
    """Compress one record with `codec` ('zstd' or 'lz4'); lossless."""
    if codec == "zstd":
        import zstandard

        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    if codec == "lz4":
        import lz4.block

        return lz4.block.compress(data, store_size=False)
    raise ValueError(f"unknown codec {codec!r}")


def decompress(codec: str, data: bytes | bytearray | memoryview, raw_nbytes: int) -> bytes:
    """Inverse of `compress`; the result has exactly `raw_nbytes` bytes.

    Raises:
        CodecError: the data does not decode, or decodes to another size.
    """
    try:
        if codec == "zstd":
            import zstandard

            if zstandard.frame_content_size(data) != raw_nbytes:  # before any allocation
                raise CodecError(f"zstd frame declares another size than {raw_nbytes}")
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_nbytes)
        elif codec == "lz4":
            import lz4.block

            out = lz4.block.decompress(data, uncompressed_size=raw_nbytes)
        else:
            raise CodecError(f"unknown codec {codec!r}")
    except CodecError:
        raise
    except Exception as exc:  # the libraries' own error types (and MemoryError on nonsense)
        raise CodecError(f"{codec} data does not decode: {exc}") from None
    if len(out) != raw_nbytes:
        raise CodecError(f"{codec} record decodes to {len(out)} bytes, not {raw_nbytes}")
    return out


__all__ = ["CODECS", "ZSTD_LEVEL", "CodecError", "compress", "decompress"]
