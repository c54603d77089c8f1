"""CI renderings of a validate report: JUnit XML and GitHub Actions workflow commands.

``validate --format junit``
    One ``<testsuite>`` for the validated model (name = its path) inside ``<testsuites>``; one ``<testcase>`` per
    rule per file: the checks of the report are grouped by (file, code), ``classname`` is the file (the model path
    for checks about the whole model) and ``name`` is ``"{check} {code}"`` (e.g. ``layers SLOT_SHAPE``).  A failed
    rule gets one ``<failure type="CODE" message="first finding">`` whose text lists every finding (tensor and
    message); a warning passes (it does not fail the gate unless ``--strict``) and carries its findings in
    ``<system-out>``.  A fatal error (the model cannot be read: exit 3) becomes a single test case with an
    ``<error>``, so the CI still gets a report.  The shape is the de-facto format of Jenkins, GitLab and the GitHub
    test-report actions; ``spec/junit.xsd`` describes exactly what is written.  Untrusted text (tensor names,
    paths, messages) has control characters made visible first (``exl2fmt.errors.escape_name``) and characters
    XML 1.0 cannot hold replaced; ``xml.etree`` escapes ``& < > "``.

``validate --format github``
    One workflow command per finding on stdout: ``::error file=F,title=T::MESSAGE`` (``::warning`` for warnings)
    naming the file and, in the title and message, the tensor; then one ``::notice`` with the verdict.  GitHub's
    escaping: in the message ``%``, ``\\r`` and ``\\n`` become ``%25``, ``%0D`` and ``%0A``; in property values also
    ``:`` and ``,`` (``%3A``, ``%2C``).  Control characters are made visible first, so a tensor name can never
    start a new workflow command.  File paths inside the workspace are written relative to it
    (``GITHUB_WORKSPACE``, else the current directory) so that annotations attach to the file.

Exit codes are those of ``validate``; these renderings only change what is printed.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timezone

from ..errors import escape_name

__all__ = ["FORMATS", "junit_xml", "github_commands", "xml_text", "gh_data", "gh_property", "CiErrorOutput"]

FORMATS = ("human", "json", "markdown", "junit", "github")

# characters XML 1.0 cannot hold at all (after escape_name has removed C0/C1 controls)
_NOT_XML = re.compile("[\ud800-\udfff\ufffe\uffff]")


def xml_text(s) -> str:
    """Untrusted text made safe for an XML attribute or text node (ElementTree adds the entity escaping)."""
    return _NOT_XML.sub(lambda m: f"\\u{ord(m.group()):04x}", escape_name("" if s is None else str(s)))


def gh_data(s) -> str:
    """A workflow command's message: control characters visible, then GitHub's %, CR, LF escapes."""
    return escape_name(str(s)).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def gh_property(s) -> str:
    """A workflow command's property value (file=, title=): as ``gh_data`` plus ``:`` and ``,``."""
    return gh_data(s).replace(":", "%3A").replace(",", "%2C")


def _rel(path: str | None) -> str | None:
    if not path:
        return path
    if "://" in path:
        return path
    base = os.environ.get("GITHUB_WORKSPACE") or os.getcwd()
    try:
        ap = os.path.abspath(path)
        rel = os.path.relpath(ap, base)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _groups(rep: dict) -> list[tuple[str, str, str, list[dict]]]:
    """(classname, check, code, findings) in report order, one per rule per file."""
    out: dict[tuple[str, str, str], list[dict]] = {}
    for c in rep.get("checks") or []:
        key = (c.get("file") or rep["path"], c["check"], c["code"])
        out.setdefault(key, []).append(c)
    return [(f, ch, code, cs) for (f, ch, code), cs in out.items()]


def _finding(c: dict) -> str:
    where = f"tensor {c['tensor']}: " if c.get("tensor") is not None else ""
    esc = " [warning escalated by --strict]" if c.get("escalated") else ""
    return f"{c['status']} {c['code']}: {where}{c['message']}{esc}"


def junit_xml(rep: dict, *, error: dict | None = None) -> str:
    """The JUnit XML document of a validate report dict (or of a fatal ``error`` {code, message, file, tensor})."""
    path = rep.get("path") if rep else (error or {}).get("file") or "exl2fmt"
    suites = ET.Element("testsuites", name="exl2fmt validate")
    suite = ET.SubElement(suites, "testsuite", name=xml_text(path))
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if error is not None:
        case = ET.SubElement(suite, "testcase", classname=xml_text(error.get("file") or path),
                             name=xml_text(f"read {error['code']}"), time="0")
        msg = (f"tensor {error['tensor']}: " if error.get("tensor") is not None else "") + str(error["message"])
        e = ET.SubElement(case, "error", type=xml_text(error["code"]), message=xml_text(msg))
        e.text = xml_text(msg)
        n["tests"], n["errors"] = 1, 1
    else:
        for cls, check, code, cs in _groups(rep):
            case = ET.SubElement(suite, "testcase", classname=xml_text(cls), name=xml_text(f"{check} {code}"),
                                 time="0")
            n["tests"] += 1
            text = "\n".join(_finding(c) for c in cs)
            if any(c["status"] == "FAIL" for c in cs):
                first = next(c for c in cs if c["status"] == "FAIL")
                f = ET.SubElement(case, "failure", type=xml_text(code),
                                  message=xml_text(_finding(first) + (f" (+{len(cs) - 1} more)" if len(cs) > 1 else "")))
                f.text = xml_text(text)
                n["failures"] += 1
            else:
                out = ET.SubElement(case, "system-out")
                out.text = xml_text(text)
    secs = f"{float(rep.get('seconds') or 0):.3f}" if rep else "0.000"
    for k, v in n.items():
        suite.set(k, str(v))
        if k != "skipped":
            suites.set(k, str(v))
    suite.set("time", secs)
    suites.set("time", secs)
    suite.set("timestamp", datetime.now(timezone.utc).replace(microsecond=0, tzinfo=None).isoformat())
    suite.set("hostname", xml_text(socket.gethostname() or "localhost"))
    props = ET.SubElement(suite, "properties")
    tool = (rep or {}).get("tool") or {}
    for k, v in (("exl2fmt.version", tool.get("version")), ("format", (rep or {}).get("format")),
                 ("deep", (rep or {}).get("deep")), ("strict", (rep or {}).get("strict")),
                 ("result", (rep or {}).get("result") or "ERROR"),
                 ("exit_code", (rep or {}).get("exit_code", (error or {}).get("exit_code")))):
        if v is not None:
            ET.SubElement(props, "property", name=k, value=xml_text(v if not isinstance(v, bool) else str(v).lower()))
    # properties first, as the schemas order it
    suite.remove(props)
    suite.insert(0, props)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def github_commands(rep: dict, *, error: dict | None = None) -> str:
    """GitHub Actions workflow commands for a validate report dict (or a fatal ``error``)."""
    lines = []
    if error is not None:
        props = [f"title={gh_property('exl2fmt ' + error['code'])}"]
        if error.get("file"):
            props.insert(0, f"file={gh_property(_rel(error['file']))}")
        msg = (f"tensor {error['tensor']}: " if error.get("tensor") is not None else "") + str(error["message"])
        lines.append(f"::error {','.join(props)}::{gh_data(msg)}")
        return "\n".join(lines) + "\n"
    for c in rep.get("checks") or []:
        if c["status"] == "PASS":
            continue
        cmd = "error" if c["status"] == "FAIL" else "warning"
        title = f"exl2fmt {c['code']}" + (f": {c['tensor']}" if c.get("tensor") is not None else "")
        props = [f"file={gh_property(_rel(c.get('file') or rep['path']))}", f"title={gh_property(title)}"]
        lines.append(f"::{cmd} {','.join(props)}::{gh_data(_finding(c))}")
    k = rep["counts"]
    verdict = (f"{rep['path']}: {k['pass']} passed, {k['warn']} warning(s), {k['fail']} failed "
               f"(exit {rep['exit_code']})")
    lines.append(f"::notice title={gh_property('exl2fmt validate ' + rep['result'])}::{gh_data(verdict)}")
    return "\n".join(lines) + "\n"


def emit(fmt: str, rep: dict | None = None, *, error: dict | None = None) -> None:
    doc = junit_xml(rep, error=error) if fmt == "junit" else github_commands(rep, error=error)
    sys.stdout.write(doc)
    sys.stdout.flush()


def CiErrorOutput(fmt: str):
    """The CLI's output sink for ``--format junit|github``: human messages on stderr, and a fatal error also as a
    CI document on stdout (so the CI reporter shows why the gate failed)."""
    from .output import Output

    class _CiOutput(Output):
        def __init__(self):
            super().__init__("human")
            self.ci_format = fmt

        def error(self, code, message, *, file=None, tensor=None, category=None, exit_code=1, hint=None):
            super().error(code, message, file=file, tensor=tensor, category=category, exit_code=exit_code, hint=hint)
            emit(fmt, None, error={"code": code, "message": message, "file": file, "tensor": tensor,
                                   "exit_code": exit_code})

        def line(self, s: str = "", style=None) -> None:  # stdout belongs to the CI document
            self.info(s)

    return _CiOutput()
