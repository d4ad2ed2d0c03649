"""PEP 517 build backend for the flashcore wheel, with no dependencies beyond the standard
library and cargo.

It builds libflashcore.so with `cargo build --release --lib` in the repository root (the
parent of the directory holding pyproject.toml), or takes $FLASHCORE_PREBUILT_LIB, and
writes a wheel (PEP 427) holding the `flashcore` package, the library, the C header and
the dist-info (METADATA from pyproject.toml's [project] table, WHEEL, RECORD).

The wheel is tagged py3-none-linux_<machine>: the Python code runs on any Python 3, the
library on Linux with the glibc it was built against (not checked against a manylinux
policy, so the tag does not claim one).
"""

import base64
import hashlib
import os
import platform
import re
import subprocess
import sys
import zipfile

PACKAGE = "flashcore"
LIB = "libflashcore.so"

_here = os.path.dirname(os.path.abspath(__file__))
PROJECT_DIR = os.path.dirname(_here)  # python/
REPO_ROOT = os.path.dirname(PROJECT_DIR)


def _project():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11: read the few fields we need by hand
        return _project_fallback()
    with open(os.path.join(PROJECT_DIR, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _project_fallback():
    text = open(os.path.join(PROJECT_DIR, "pyproject.toml"), encoding="utf-8").read()
    section = text.split("[project]", 1)[1].split("\n[", 1)[0]
    out = {}
    for key in ("name", "version", "description", "readme", "requires-python", "license"):
        m = re.search(rf'^{key} = "(.*)"$', section, re.M)
        if m:
            out[key] = m.group(1)
    m = re.search(r"^dependencies = \[(.*)\]$", section, re.M)
    out["dependencies"] = re.findall(r'"([^"]+)"', m.group(1)) if m else []
    return out


def _cargo_version():
    text = open(os.path.join(REPO_ROOT, "Cargo.toml"), encoding="utf-8").read()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def _package_version():
    text = open(os.path.join(PROJECT_DIR, PACKAGE, "__init__.py"), encoding="utf-8").read()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def _check_versions(project):
    versions = {
        "pyproject.toml": project["version"],
        "Cargo.toml": _cargo_version(),
        "flashcore/__init__.py": _package_version(),
    }
    if len(set(versions.values())) != 1:
        raise RuntimeError(f"flashcore_build: versions disagree: {versions}")


def _build_library():
    prebuilt = os.environ.get("FLASHCORE_PREBUILT_LIB")
    if prebuilt:
        return prebuilt
    subprocess.run(["cargo", "build", "--release", "--lib"], cwd=REPO_ROOT, check=True, stdout=sys.stderr)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO_ROOT, "target"))
    return os.path.join(target, "release", LIB)


def _metadata(project):
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project.get('description', '')}",
        f"License: {project.get('license', '')}",
        f"Requires-Python: {project.get('requires-python', '>=3')}",
    ]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    for extra, deps in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {d}; extra == "{extra}"' for d in deps]
    readme = project.get("readme")
    body = ""
    if readme and os.path.exists(os.path.join(PROJECT_DIR, readme)):
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + open(os.path.join(PROJECT_DIR, readme), encoding="utf-8").read()
    return "\n".join(lines) + "\n" + body


def _tag():
    if sys.platform != "linux":
        raise RuntimeError(f"flashcore_build: only Linux wheels are built (this is {sys.platform})")
    machine = platform.machine().lower().replace("-", "_")
    return f"py3-none-linux_{machine}"


def _files(lib_path):
    """(path in the wheel, path on disk) of every file the package ships."""
    pkg_dir = os.path.join(PROJECT_DIR, PACKAGE)
    out = []
    for name in sorted(os.listdir(pkg_dir)):
        if name.endswith(".py") or name == "py.typed":
            out.append((f"{PACKAGE}/{name}", os.path.join(pkg_dir, name)))
    out.append((f"{PACKAGE}/{LIB}", lib_path))
    out.append((f"{PACKAGE}/include/flashcore.h", os.path.join(REPO_ROOT, "include", "flashcore.h")))
    return out


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    _check_versions(project)
    lib_path = _build_library()
    if not os.path.isfile(lib_path):
        raise RuntimeError(f"flashcore_build: {lib_path} was not built")
    name, version, tag = project["name"], project["version"], _tag()
    dist_info = f"{name}-{version}.dist-info"
    wheel_name = f"{name}-{version}-{tag}.whl"
    contents = [(arc, open(src, "rb").read()) for arc, src in _files(lib_path)]
    contents.append((f"{dist_info}/METADATA", _metadata(project).encode()))
    wheel_meta = f"Wheel-Version: 1.0\nGenerator: flashcore_build\nRoot-Is-Purelib: false\nTag: {tag}\n"
    contents.append((f"{dist_info}/WHEEL", wheel_meta.encode()))
    record = [_record_line(arc, data) for arc, data in contents] + [f"{dist_info}/RECORD,,"]
    contents.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))

    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, wheel_name)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for arc, data in contents:
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return wheel_name


def get_requires_for_build_wheel(config_settings=None):
    return []
