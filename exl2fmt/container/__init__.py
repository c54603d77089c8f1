"""The safetensors container: the one parser, reader and writer of the project, and atomic publishing.

Every module that reads or writes safetensors - inspect, validate, the converters, the quantizer - goes through
this package; none has a reader or a header serializer of its own.

================  =================================================================================================
module            holds
================  =================================================================================================
``dtypes``        the dtype table (safetensors <-> numpy, bits per element, raw dtypes) and bf16 <-> f32 bit math
``parse``         the header parser: the file format's rules in the order they are checked, limits, JSON rules,
                  and what is stricter than the reference (``STRICTER_THAN_REFERENCE``)
``reader``        ``read_header``, ``SafetensorsFile`` / ``ModelFiles`` (memory-mapped, zero-copy views),
                  ``open_model`` with the index <-> shard rules, and ``SourceReader`` (``pread`` into private
                  arrays, for passes over a whole model)
``regular``       ``stat_regular`` / ``open_regular``: regular files only (a FIFO or device is IO_ERROR, never opened
                  blocking)
``jsonload``      the one guarded loader of JSON side inputs (config.json, the index, tokenizer files,
                  measurement.json, job.json, calibration ids): byte / value-count / depth caps, every parser error
                  mapped to the kind's code, and shape helpers (``expect``, ``expect_list_of``, ``expect_dict_of``)
``writer``        one header builder, one shard plan and naming, the index text; ``write_safetensors`` /
                  ``write_sharded`` (whole files) and ``ShardWriter`` / ``BackgroundWriter`` (streamed)
``publish``       atomic write of one file, the working-directory-then-rename publishing of a model directory,
                  path rules (``check_paths``), naming OS errors
``partials``      owner markers of working directories, removal of stale ones, the interrupt shield
``checksums``     the Fletcher checksum of written bytes (Numba; imported only by the streaming writer and verify)
================  =================================================================================================

The names below are re-exported here, so ``from exl2fmt.container import open_model`` is the usual spelling.
Importing this package loads the standard library only (numpy on the first array, never torch, numba, rich or typer); the writer's
names are resolved on first use, so reading a model (inspect, validate) does not load the writer and its
publishing helpers.
"""

from __future__ import annotations

from .dtypes import (RAW_DTYPES, DtypeSpec, bf16_bits_to_f32, f16_to_bf16_bits, f32_to_bf16_bits,
                     numpy_to_safetensors_dtype)
from .parse import (JSON_MAX_DEPTH, MAX_HEADER_BYTES, MAX_NDIM, MAX_TENSORS, STRICTER_THAN_REFERENCE,
                    SafetensorsHeader, TensorInfo, parse_header)
from .reader import (INDEX_NAME, MAX_CONFIG_BYTES, MAX_INDEX_BYTES, MAX_OPEN_SHARDS, ModelFiles, SafetensorsFile,
                     SourceReader, file_kind, open_model, open_regular, read_header)
__all__ = [
    "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NDIM", "JSON_MAX_DEPTH", "MAX_INDEX_BYTES", "MAX_CONFIG_BYTES",
    "MAX_OPEN_SHARDS", "INDEX_NAME", "DtypeSpec", "SAFETENSORS_DTYPES", "RAW_DTYPES", "STRICTER_THAN_REFERENCE",
    "TensorInfo", "SafetensorsHeader", "read_header", "parse_header", "SafetensorsFile", "ModelFiles",
    "open_model", "SourceReader", "RawTensor", "numpy_to_safetensors_dtype", "serialize", "write_safetensors",
    "write_sharded", "OutSpec", "build_header", "plan_shards", "shard_names", "ShardWriter", "BackgroundWriter",
    "file_kind", "open_regular", "f32_to_bf16_bits", "f16_to_bf16_bits", "bf16_bits_to_f32",
]

_WRITER_NAMES = frozenset({"BackgroundWriter", "OutSpec", "RawTensor", "ShardWriter", "build_header", "plan_shards",
                           "serialize", "shard_names", "write_safetensors", "write_sharded"})


def __getattr__(name: str):
    if name == "SAFETENSORS_DTYPES":  # numpy dtypes: built on first use, so reading headers does not import numpy
        from . import dtypes

        value = dtypes.SAFETENSORS_DTYPES
        globals()[name] = value
        return value
    if name in _WRITER_NAMES:
        from . import writer

        value = getattr(writer, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _WRITER_NAMES)
