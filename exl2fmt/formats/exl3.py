"""EXL3 (ExLlamaV3 trellis codes with Hadamard rotations): the layer class and its inspect row.

``Exl3Linear`` holds a layer's arrays under their slot names (``Exl3Slot``).  The geometry comes from the tensors
(``trellis`` [K_p/16, N_p/16, 16 x rate]) and the true features from config.json when it names the layer (else
K = K_p, N = N_p).  The rules (spec/exl3.md section 1), each with its code:

* ``trellis`` present, int16, 3-D (SLOT_MISSING / SLOT_DTYPE / SLOT_SHAPE); its last dim is 16 x rate for a rate in
  ``layout.EXL3_RATES`` (EXL3_RATE: a last dim that no rate gives, or a rate outside 1..8);
* K_p and N_p multiples of 128 that pad the features by less than 128 (EXL3_PADDING);
* ``suh`` (or the legacy ``su``) and ``svh`` (or ``sv``) present (SLOT_MISSING) and of the padded lengths
  (SLOT_SHAPE); ``bias`` N_p or N long (SLOT_SHAPE);
* at most one codebook marker, each the I32 scalar exllamav3 checks (EXL3_MARKER); a half rate carries ``mul1``
  (EXL3_HALF_RATE);
* the pre-suh per-tensor ``scale`` is refused (FORMAT_UNSUPPORTED): exllamav3 1.6.5 ignores it, so what such a
  file means is not defined by the reference;
* a quantized token embedding (``--embed_bits``: a 2-D ``trellis`` [vocab, G x (1 + 16 K)] of rings under an
  embedding key, spec/exl3.md section 8) is refused (FORMAT_UNSUPPORTED), naming the rate its shape gives;
* ``deep``: suh / svh / bias finite (NONFINITE_VALUES).  Every bit pattern of a ring decodes, so a layer that passes
  the structural rules is decodable.

The decode is ``exl2fmt.codec.exl3.dequantize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from ..lazynp import np  # numpy on first use: inspect reads headers only

from ..errors import ErrorCode, Exl2Error, Issue, Severity
from ..layout import (EXL3_CODEBOOKS, EXL3_HALF_RATES, EXL3_MARKER_VALUES, EXL3_PAD, EXL3_RATE_OF_LAST_DIM,
                      EXL3_RATES, Exl3Geometry, Exl3Slot, Format, pad128)
from .common import LinearBase

__all__ = ["Exl3Linear", "inspect_facts", "codebook_of_slots", "rate_of_last_dim", "fits_padding",
           "is_quantized_embedding", "embedding_refusal", "refuse_quantized_embedding"]

#: marker slot -> codebook name; no marker is 3inst
_MARKER_CODEBOOK = {Exl3Slot.MCG: EXL3_CODEBOOKS[1], Exl3Slot.MUL1: EXL3_CODEBOOKS[2]}


def rate_of_last_dim(last: int) -> float | int | None:
    """The rate a trellis last dim encodes (16 x rate), or None for a dim no legal rate gives."""
    return EXL3_RATE_OF_LAST_DIM.get(int(last))


def codebook_of_slots(names) -> str | None:
    """The codebook the marker slots among ``names`` select (None: both markers, which is invalid)."""
    present = [c for m, c in _MARKER_CODEBOOK.items() if m in names]
    if len(present) > 1:
        return None
    return present[0] if present else EXL3_CODEBOOKS[0]


def fits_padding(features: int, padded: int) -> bool:
    """``padded`` is the 128-multiple EXL3 pads ``features`` to (0 < features <= padded < features + 128)."""
    return 0 < features <= padded and padded % EXL3_PAD == 0 and padded - features < EXL3_PAD


def is_quantized_embedding(key: str, trellis_shape) -> bool:
    """``<key>.trellis`` is exllamav3's quantized token embedding (spec/exl3.md section 8), not a linear: the
    trellis is 2-D (rows of rings, [vocab, G x (1 + 16 K)]) under an embedding key (``embed_tokens``, ``wte``,
    ``word_embeddings`` ...)."""
    leaf = key.rsplit(".", 1)[-1].lower()
    return len(tuple(trellis_shape)) == 2 and ("embed" in leaf or leaf == "wte")


def _embedding_rates(row_words: int) -> list[int]:
    """The rates K = 1..8 whose rings (1 + 16 K words each) tile a row of ``row_words`` words."""
    return [k for k in range(1, 9) if row_words > 0 and row_words % (1 + 16 * k) == 0]


def embedding_refusal(key: str, trellis_shape) -> str:
    """The message of the FORMAT_UNSUPPORTED finding for a quantized embedding: its shape and derived rate."""
    rows, words = (int(d) for d in trellis_shape)
    rates = _embedding_rates(words)
    rate = (f"rate {rates[0]} ({words // (1 + 16 * rates[0])} ring(s) of {1 + 16 * rates[0]} words per row)"
            if len(rates) == 1 else "rate " + (" or ".join(map(str, rates)) if rates else "unknown") +
            f" ({words} words per row)")
    return (f"quantized EXL3 token embedding (exllamav3 --embed_bits ring format, trellis [{rows}, {words}], {rate}) "
            "is not supported: exl2fmt decodes EXL3 linears only; re-quantize without --embed_bits")


def refuse_quantized_embedding(info) -> None:
    """Raise ``Exl2Error(FORMAT_UNSUPPORTED)`` when the detected layer ``info`` (a ``detect.LayerInfo``) is a
    quantized embedding: the converters call it while planning, before any tensor data is read."""
    tr = info.slots.get(Exl3Slot.TRELLIS) if info.format is Format.EXL3 else None
    if tr is not None and is_quantized_embedding(info.key, tr.shape):
        raise Exl2Error(ErrorCode.FORMAT_UNSUPPORTED, embedding_refusal(info.key, tr.shape),
                        tensor=f"{info.key}.{Exl3Slot.TRELLIS.value}",
                        file=str(tr.file) if getattr(tr, "file", None) else None)


def _rate_text(r) -> str:
    return f"{r:g}"


@dataclass(frozen=True, eq=False)
class Exl3Linear(LinearBase):
    """An EXL3 linear layer.  ``tensors`` maps slot name (``trellis`` ...) -> array; ``dtypes`` slot name ->
    safetensors dtype.  ``in_features_hint`` / ``out_features_hint``: the true K / N config.json gives (None:
    unknown, the padded sizes are used)."""

    format: ClassVar[Format] = Format.EXL3
    key: str
    tensors: Mapping[str, np.ndarray]
    dtypes: Mapping[str, str]
    in_features_hint: int | None = None
    out_features_hint: int | None = None
    file: str | None = None

    # ------------------------------------------------------------------ geometry (valid only after validate)

    @property
    def padded(self) -> tuple[int, int]:
        """(K_p, N_p) = 16 x the trellis tile counts."""
        t = self.tensors[Exl3Slot.TRELLIS].shape
        return 16 * int(t[0]), 16 * int(t[1])

    @property
    def rate(self) -> float | int | None:
        """Bits per weight of the trellis (1..8, 1.5, 2.5, 3.5), None when the last dim is not 16 x a rate."""
        return rate_of_last_dim(self.tensors[Exl3Slot.TRELLIS].shape[2])

    @property
    def codebook(self) -> str | None:
        return codebook_of_slots(self.tensors)

    def _feature(self, hint: int | None, padded: int) -> int:
        return hint if hint is not None and fits_padding(hint, padded) else padded

    @property
    def in_features(self) -> int:
        return self._feature(self.in_features_hint, self.padded[0])

    @property
    def out_features(self) -> int:
        return self._feature(self.out_features_hint, self.padded[1])

    @property
    def geometry(self) -> Exl3Geometry:
        K_p, N_p = self.padded
        return Exl3Geometry(K=self.in_features, N=self.out_features, K_p=K_p, N_p=N_p, bits=self.rate)

    def plan(self) -> str:
        """``<rate>b trellis <codebook>``, e.g. ``2.5b trellis mul1``."""
        self.raise_if_invalid()
        return f"{_rate_text(self.rate)}b trellis {self.codebook}"

    # ------------------------------------------------------------------ rules

    def validate(self, deep: bool = False) -> list[Issue]:
        tr = self.tensors.get(Exl3Slot.TRELLIS)
        if tr is not None and is_quantized_embedding(self.key, tr.shape):
            return [self._issue(ErrorCode.FORMAT_UNSUPPORTED, embedding_refusal(self.key, tr.shape), Exl3Slot.TRELLIS)]
        issues = self._slot_presence_and_dtypes()
        if Exl3Slot.SCALE in self.tensors:
            issues.append(self._issue(ErrorCode.FORMAT_UNSUPPORTED, "legacy per-tensor 'scale' (EXL3 before suh/svh) "
                                      "is not supported: exllamav3 1.6.5 ignores it, so the layer's weight is not "
                                      "defined; re-quantize with a current exllamav3", Exl3Slot.SCALE))
        if any(i.code is ErrorCode.SLOT_MISSING for i in issues):
            return issues
        for fp16, legacy in ((Exl3Slot.SUH, Exl3Slot.SU), (Exl3Slot.SVH, Exl3Slot.SV)):
            if fp16 not in self.tensors and legacy not in self.tensors:
                issues.append(self._issue(ErrorCode.SLOT_MISSING, f"required exl3 tensor '{fp16}' (or the legacy "
                                          f"'{legacy}') is missing", fp16))
        tr = self.tensors[Exl3Slot.TRELLIS]
        if len(tr.shape) != 3:
            return issues + [self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(tr.shape)}; expected 3-D "
                                         "(K_p/16, N_p/16, 16*rate)", Exl3Slot.TRELLIS)]
        last = int(tr.shape[2])
        if rate_of_last_dim(last) is None:
            if last % 8 == 0 and last > 0:
                why = f"rate {last / 16:g} is outside what exllamav3 reads ({', '.join(map(_rate_text, EXL3_RATES))})"
            else:
                why = "not 16 x a whole or half rate"
            return issues + [self._issue(ErrorCode.EXL3_RATE, f"trellis last dim {last}: {why}", Exl3Slot.TRELLIS)]
        issues += self._marker_issues()
        cb = self.codebook
        if self.rate in EXL3_HALF_RATES and cb is not None and cb != EXL3_CODEBOOKS[2]:
            issues.append(self._issue(ErrorCode.EXL3_HALF_RATE, f"rate {_rate_text(self.rate)} (trellis last dim "
                                      f"{last}) needs the mul1 codebook marker; the layer's codebook is {cb}",
                                      Exl3Slot.TRELLIS))
        issues += self._padding_issues()
        if any(i.code in (ErrorCode.SLOT_MISSING, ErrorCode.EXL3_PADDING) for i in issues):
            return issues
        issues += self._slot_shapes(self.geometry, skip=(Exl3Slot.BIAS,))
        if Exl3Slot.BIAS in self.tensors:
            b = tuple(self.tensors[Exl3Slot.BIAS].shape)
            if b not in ((self.geometry.N_p,), (self.out_features,)):
                issues.append(self._issue(ErrorCode.SLOT_SHAPE, f"shape {list(b)}; expected [{self.geometry.N_p}] "
                                          f"(N_p) or [{self.out_features}] (N)", Exl3Slot.BIAS))
        if deep and not any(i.severity is Severity.ERROR for i in issues):
            for s in (Exl3Slot.SUH, Exl3Slot.SVH, Exl3Slot.BIAS):
                issues += self._finite(s)
        return issues

    def _marker_issues(self) -> list[Issue]:
        present = [m for m in _MARKER_CODEBOOK if m in self.tensors]
        if len(present) > 1:
            return [self._issue(ErrorCode.EXL3_MARKER, "both codebook markers mcg and mul1 are present; a layer "
                                "has at most one", Exl3Slot.MUL1)]
        out = []
        for m in present:
            a = self.tensors[m]
            if tuple(a.shape) != () or self.dtypes[m] != "I32":
                continue  # SLOT_SHAPE / SLOT_DTYPE name it
            v = int(np.asarray(a).reshape(()).astype(np.int64))
            want = EXL3_MARKER_VALUES[m]
            if v != want:
                out.append(self._issue(ErrorCode.EXL3_MARKER, f"marker value {v & 0xFFFFFFFF:#010x}; the {m} marker "
                                       f"must hold {want & 0xFFFFFFFF:#010x}", m))
        return out

    def _padding_issues(self) -> list[Issue]:
        K_p, N_p = self.padded
        out = []
        for name, padded, hint in (("in", K_p, self.in_features_hint), ("out", N_p, self.out_features_hint)):
            if padded == 0 or padded % EXL3_PAD:
                out.append(self._issue(ErrorCode.EXL3_PADDING, f"padded {name}_features {padded} (16 x "
                                       f"{padded // 16} tiles) is not a positive multiple of {EXL3_PAD}",
                                       Exl3Slot.TRELLIS))
            elif hint is not None and not fits_padding(hint, padded):
                out.append(self._issue(ErrorCode.EXL3_PADDING, f"config.json gives {name}_features = {hint}, which "
                                       f"pads to {pad128(hint) if hint > 0 else '?'}, but the trellis holds {padded}",
                                       Exl3Slot.TRELLIS))
        return out

    # ------------------------------------------------------------------ decode

    def _signs(self, fp16: str, legacy: str) -> np.ndarray:
        from ..codec.exl3 import unpack_sign_bits

        if fp16 in self.tensors:
            return np.asarray(self.tensors[fp16])
        return unpack_sign_bits(np.asarray(self.tensors[legacy]))

    def dequantize(self) -> np.ndarray:
        """``nn.Linear`` weight float16 [out_features, in_features] (spec/exl3.md: exact inner weight, the
        Hadamard stage in the canonical fp32 order)."""
        from ..codec.exl3 import dequantize

        self.raise_if_invalid(deep=True)  # the rules validate --deep and convert apply, before decoding
        k2 = int(2 * self.rate)
        return dequantize(np.asarray(self.tensors[Exl3Slot.TRELLIS]), self._signs(Exl3Slot.SUH, Exl3Slot.SU),
                          self._signs(Exl3Slot.SVH, Exl3Slot.SV), k2, self.codebook, self.in_features,
                          self.out_features)

    #: an upper bound of |codebook value| for all three codebooks and all 65536 states (3INST / MCG: the sum of two
    #: fp16 halves whose exponent field the lop3 mask keeps below 2.0 each; MUL1: |h x fp16(0x1EEE) + fp16(0xC931)|
    #: for h in 1024..2044 stays under 3.6; tests/test_exl3_codec.py checks it on every state)
    CODEBOOK_BOUND: ClassVar[float] = 4.0

    def _decode_is_finite(self) -> bool:
        """No decoded weight can be NaN or Inf when the stage bounds stay in fp16's range (spec/exl3.md section 5):
        |A| <= 128 x 4 / sqrt(128) = 4 sqrt(128) after the left Hadamard, |B| <= |A| max|suh|, |C| <= sqrt(128)
        max|B| = 512 max|suh|, |D| <= |C| max|svh| (a 1 % margin covers the fp32 sums' and the fp16 roundings'
        relative errors; rounding is monotone).  suh / svh are finite (the deep checks); legacy su / sv are signs.
        O(K + N), so the output need not be scanned; a layer near the fp16 range is counted in the output."""
        def amax(fp16: str) -> float:
            if fp16 not in self.tensors:
                return 1.0          # legacy signs
            a = np.asarray(self.tensors[fp16]).astype(np.float32)
            return float(np.abs(a).max()) if a.size else 0.0

        with np.errstate(over="ignore", invalid="ignore"):
            su, sv = amax(Exl3Slot.SUH), amax(Exl3Slot.SVH)
        if not (np.isfinite(su) and np.isfinite(sv)):
            return False
        margin, top = 1.01, 65504.0
        a = self.CODEBOOK_BOUND * 128 ** 0.5 * margin
        b = a * su * margin
        d = b * 128 ** 0.5 * sv * margin
        return b <= top and d <= top

    def bias(self) -> np.ndarray | None:
        if Exl3Slot.BIAS not in self.tensors:
            return None
        from .common import as_float32

        b = as_float32(np.asarray(self.tensors[Exl3Slot.BIAS]), self.dtypes[Exl3Slot.BIAS])
        return b[: self.out_features].astype(np.float16)

    def bpw(self) -> float:
        """Every stored bit (trellis incl. padding, suh / svh or su / sv, marker, bias) over the true
        K x N (+ N with a bias)."""
        self.raise_if_invalid()
        K, N = self.in_features, self.out_features
        return 8 * self.stored_bytes() / (K * N + (N if self.has_bias else 0))


# ---------------------------------------------------------------------------------------------------- inspect


def inspect_facts(model, info, config, issues: list[Issue], features=None) -> dict:
    """The EXL3 part of an ``inspect`` layer row, from the headers only (``info`` a ``detect.LayerInfo``):
    K / N the true features where config.json names them and they pad to the stored K_p / N_p (else the padded
    sizes), ``plan`` ``<rate>b trellis <codebook>``, ``hist`` rate -> K x N, ``codebook``.  ``bpw`` is left to
    the row (stored bits / (K N + N bias), so the padding and suh / svh count as overhead)."""
    if features is None:
        from ..arch import features_of

        features = features_of(config)
    out = {"K": info.in_features, "N": info.out_features, "G": None, "plan": None, "hist": {}, "act": None,
           "bpw": None, "error": None, "codebook": None}
    tr = info.slots.get(Exl3Slot.TRELLIS)
    if tr is not None and is_quantized_embedding(info.key, tr.shape):
        msg = embedding_refusal(info.key, tr.shape)
        out["error"] = "quantized embedding: not supported"
        issues.append(Issue(ErrorCode.FORMAT_UNSUPPORTED, msg, tensor=f"{info.key}.{Exl3Slot.TRELLIS.value}",
                            file=str(tr.file) if getattr(tr, "file", None) else None))
        return out
    if tr is None or len(tr.shape) != 3:
        out["error"] = "trellis missing or not 3-D"
        return out
    K_p, N_p = 16 * int(tr.shape[0]), 16 * int(tr.shape[1])
    k_cfg, n_cfg = features(info.key)
    K = k_cfg if k_cfg is not None and fits_padding(k_cfg, K_p) else K_p
    N = n_cfg if n_cfg is not None and fits_padding(n_cfg, N_p) else N_p
    rate = rate_of_last_dim(tr.shape[2])
    cb = codebook_of_slots(info.slots)
    out.update(K=K, N=N, codebook=cb)
    if rate is None:
        out["error"] = f"trellis last dim {tr.shape[2]} is not 16 x an EXL3 rate"
    elif cb is None:
        out["error"] = "both codebook markers mcg and mul1"
    else:
        out["plan"] = f"{_rate_text(rate)}b trellis {cb}"
        out["hist"] = {rate: K * N}
    # the rules a header shows, as findings (validate checks them all, with the tensor data)
    file = str(tr.file) if getattr(tr, "file", None) else None
    where = f"{info.key}.{Exl3Slot.TRELLIS.value}"
    if rate is None:
        issues.append(Issue(ErrorCode.EXL3_RATE, f"{out['error']} (1..8, 1.5, 2.5, 3.5)", tensor=where, file=file))
    elif rate in EXL3_HALF_RATES and cb is not None and cb != EXL3_CODEBOOKS[2]:
        issues.append(Issue(ErrorCode.EXL3_HALF_RATE, f"rate {_rate_text(rate)} needs the mul1 codebook marker; the "
                            f"layer's codebook is {cb}", tensor=where, file=file))
    if cb is None:
        issues.append(Issue(ErrorCode.EXL3_MARKER, f"{out['error']}: a layer has at most one", tensor=where, file=file))
    if K_p == 0 or N_p == 0 or K_p % EXL3_PAD or N_p % EXL3_PAD:
        issues.append(Issue(ErrorCode.EXL3_PADDING, f"padded sizes {K_p} x {N_p} (16 x the trellis tiles) are not "
                            f"positive multiples of {EXL3_PAD}", tensor=where, file=file))
    if Exl3Slot.SCALE in info.slots:
        issues.append(Issue(ErrorCode.FORMAT_UNSUPPORTED, "legacy per-tensor 'scale' (EXL3 before suh/svh) is not "
                            "supported: exllamav3 1.6.5 ignores it", tensor=f"{info.key}.{Exl3Slot.SCALE.value}",
                            file=file))
    return out
