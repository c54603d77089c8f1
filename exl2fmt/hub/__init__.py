"""Models on the Hugging Face Hub, read without downloading them: ``hf://ORG/REPO[@REVISION][/PATH]``.

EXL2 models are published as one branch per bitrate (``4.0bpw``, ``6.5bpw``, ...) of tens of GB each.
``inspect`` and the structural checks of ``validate`` only need the safetensors headers, ``config.json``, the
index and - for the EXL2 group plans - the tiny ``q_groups`` tables (for EXL3: the 4-byte codebook markers and
``quantization_config.json``), so this module fetches exactly those bytes
with HTTP range requests and nothing else.

How a model is read (``fetch_snapshot``)
----------------------------------------
1. The folder is listed with the Hub's tree API (``GET {endpoint}/api/models/{repo}/tree/{revision}/{path}``,
   the endpoint ``HfApi.list_repo_tree`` calls, paginated by ``Link`` headers).  A revision that does not exist
   is answered with the repository's branches and tags (``GET .../refs``, as ``HfApi.list_repo_refs``).
2. Every file that is read gets one ``HEAD`` through ``huggingface_hub.get_hf_file_metadata`` on the URL of
   ``hf_hub_url``: its size (``X-Linked-Size``), the commit (``X-Repo-Commit``) and where the bytes are (the CDN
   location of a redirect).  The first answer pins the commit: every later file is read at that commit, so a
   branch that moves during the read cannot mix two versions.
3. ``config.json``, ``quantize_config.json``, ``*.safetensors.index.json`` and EXL3's ``quantization_config.json``
   are read whole (at most ``MAX_JSON_BYTES`` each; a larger ``quantization_config.json`` is left out and its
   ``tensor_storage`` checks with it).  Each ``*.safetensors`` file is read with two range requests: bytes
   ``[0, 8)`` (the header length ``n``, checked against ``exl2fmt.container.MAX_HEADER_BYTES`` and the file size
   before anything is allocated) and ``[8, 8 + n)``; the header is then validated by
   ``exl2fmt.container.parse_header`` (the one parser of the project).  EXL2 ``*.q_groups`` tensors (I16, at
   most ``MAX_GROUPS_BYTES``) and EXL3 ``*.mcg`` / ``*.mul1`` markers (I32 scalars, whose value validate checks)
   are read by range too.
   A ``.gguf`` file (``hf://ORG/REPO/x.gguf``) is read in growing prefixes until the project's GGUF pre-scan
   finds its whole header inside bytes actually fetched (``_fetch_gguf``; GGUF does not state its header length).
4. The bytes land in a *sparse* local image of each file (its real size, holes everywhere else) in a temporary
   directory, which ``exl2fmt.inspect`` / ``exl2fmt.validate`` then open like any local model: the same report, the
   same rules.  Nothing there reads the holes (``validate --deep`` is refused for ``hf://`` paths).  A filesystem
   that cannot hold sparse files is detected (allocated blocks are checked) and refused.

Hardening
---------
* Every response body is streamed and cut at the expected length: a range answered with ``200`` (the whole file),
  a wrong ``Content-Range``, a body longer than the range (an endless body) or a JSON document past its cap is
  ``HUB_BAD_RESPONSE`` after reading at most one chunk beyond the expected length.
* At most ``MAX_BYTES_PER_FILE`` are fetched per file, and at most a byte budget per command
  (``EXL2FMT_HUB_MAX_BYTES``: bytes or e.g. ``512M``, default ``DEFAULT_MAX_TOTAL_BYTES`` = 256 MiB) over all
  requests: a range is counted before it is asked for, other bodies as they arrive (``HUB_FETCH_LIMIT``);
  declared sizes above ``MAX_FILE_SIZE`` are refused.  A ``.gguf`` file's 24-byte preamble (magic, version,
  counts) is checked before anything more of it is asked for.
* Time: each request (listing page, HEAD, ranged GET, each redirect hop) has a wall-clock deadline of
  ``EXL2FMT_HUB_TIMEOUT`` seconds (default 60) that also holds while the response headers trickle in (the HTTP
  library's read timeout restarts at every byte; the request runs in a thread the caller stops waiting for), and
  the command's reads together a deadline of ``EXL2FMT_HUB_TOTAL_TIMEOUT`` seconds (default 600):
  ``HUB_UNREACHABLE`` naming the ``hf://`` file.
* Names from the server are checked before they name a local file (``unsafe_name``: control and format
  characters, backslashes, absolute paths, ``.``/``..``/empty segments, components over 255 bytes): a listing
  with such a name is ``HUB_BAD_RESPONSE``, the name printed escaped; errors about the local image name the
  ``hf://`` path, never the temporary directory.
* Redirects are followed by hand, at most ``MAX_REDIRECTS``, to ``http(s)`` URLs only and never from ``https`` to
  ``http``.  The token (``HF_TOKEN`` or the saved login, through ``huggingface_hub.utils.build_hf_headers``) is
  only sent to the endpoint's own origin (scheme, host, port): a redirect to another host - the Hub's CDN hands
  out signed URLs - is followed without it.  (The metadata ``HEAD`` follows ``get_hf_file_metadata``'s own rule:
  redirects on the same or a known Hub origin only; it stops at the CDN redirect and reads the size from it.)
* ``HF_ENDPOINT`` selects the server (a mirror, or a local emulation in the tests); ``HF_HUB_OFFLINE=1`` refuses
  with ``HUB_UNREACHABLE``.

Stable codes: ``HUB_NOT_FOUND`` (repository, revision or file missing), ``HUB_ACCESS_DENIED`` (401/403, gated),
``HUB_UNREACHABLE`` (network, timeout, 429/5xx, offline), ``HUB_BAD_RESPONSE``, ``HUB_FETCH_LIMIT``, and the
container's own codes (``HEADER_TOO_LARGE`` ...) for a malformed header.  Without ``huggingface_hub``:
``UNSUPPORTED_INPUT`` with ``pip install 'exl2fmt[hub]'`` (exit 3).
"""

from __future__ import annotations

from .client import (DEFAULT_MAX_TOTAL_BYTES, DEFAULT_TOTAL_TIMEOUT, MAX_FILE_SIZE, MAX_JSON_BYTES, MAX_REDIRECTS,
                     READ_CHUNK, HubClient, HubStats)
from .paths import HUB_SCHEME, MAX_NAME_BYTES, MAX_PATH_BYTES, HubRef, is_hub_uri, parse_hub_uri, unsafe_name
from .reports import inspect_hub, remote_errors, rewrite_paths, to_remote
from .snapshot import GGUF_PREAMBLE, MAX_BYTES_PER_FILE, MAX_GROUPS_BYTES, HubSnapshot, fetch_snapshot

__all__ = ["HUB_SCHEME", "READ_CHUNK", "HubClient", "MAX_JSON_BYTES", "MAX_GROUPS_BYTES", "MAX_BYTES_PER_FILE",
           "MAX_FILE_SIZE", "MAX_REDIRECTS", "HubRef", "HubStats", "HubSnapshot", "is_hub_uri", "parse_hub_uri",
           "fetch_snapshot", "inspect_hub", "rewrite_paths", "remote_errors", "to_remote", "unsafe_name",
           "DEFAULT_MAX_TOTAL_BYTES", "DEFAULT_TOTAL_TIMEOUT", "MAX_NAME_BYTES", "MAX_PATH_BYTES", "GGUF_PREAMBLE"]
