"""The ``inspect`` report of an ``hf://`` model: the local report of its sparse image, every path in ``hf://``
form; ``remote_errors`` / ``to_remote`` do the same for errors and for other reports (``exl2fmt.validate.remote``)."""

from __future__ import annotations

from typing import Any

from ..errors import Exl2Error
from .paths import HubRef, parse_hub_uri
from .snapshot import HubSnapshot, fetch_snapshot

__all__ = ["rewrite_paths", "inspect_hub", "remote_errors", "to_remote"]


def rewrite_paths(doc: Any, local: str, remote: str) -> Any:
    """Replace the temporary image's path ``local`` by the ``hf://`` form in every string of a report."""
    if isinstance(doc, dict):
        return {k: rewrite_paths(v, local, remote) for k, v in doc.items()}
    if isinstance(doc, list):
        return [rewrite_paths(v, local, remote) for v in doc]
    if isinstance(doc, str) and local in doc:
        return doc.replace(local, remote)
    return doc


def inspect_hub(uri: str, *, revision: str | None = None, layers: bool = True) -> dict:
    """``exl2fmt inspect hf://...``: the local inspect report of the headers, paths in ``hf://`` form, plus
    ``hub`` (repo, revision, commit, bytes fetched vs model size, requests)."""
    from ..inspect import inspect_model

    ref = parse_hub_uri(uri, revision)
    with fetch_snapshot(ref) as snap:
        with remote_errors(snap, ref):
            rep = inspect_model(snap.target, layers=layers)
        rep = to_remote(rep, snap, ref)
        if rep.get("input") == "gguf":
            rep["files"] = [{"path": ref.uri(), "bytes": snap.files[0]["size"], "tensors": rep["summary"]["tensors"]}]
        rep["hub"] = snap.as_dict()
    return rep


class remote_errors:
    """Re-raise an ``Exl2Error`` about the local image with the ``hf://`` paths."""

    def __init__(self, snap: HubSnapshot, ref: HubRef):
        self.local = str(snap.target if snap.target.is_dir() else snap.target.parent)
        self.remote = HubRef(ref.repo_id, ref.revision, ref.path.rpartition("/")[0]
                             if ref.path.endswith((".safetensors", ".gguf")) else ref.path).uri()

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if isinstance(e, Exl2Error) and (self.local in (e.file or "") or self.local in e.message):
            raise Exl2Error(e.code, e.message.replace(self.local, self.remote),
                            file=(e.file or "").replace(self.local, self.remote) or None, tensor=e.tensor) from None
        return False


def to_remote(doc: dict, snap: HubSnapshot, ref: HubRef) -> dict:
    mirror = str(snap.target if snap.target.is_dir() else snap.target.parent)
    base = HubRef(ref.repo_id, ref.revision, ref.path.rpartition("/")[0]
                  if ref.path.endswith((".safetensors", ".gguf")) else ref.path).uri()
    doc = rewrite_paths(doc, mirror, base)
    doc["path"] = ref.uri()
    return doc
