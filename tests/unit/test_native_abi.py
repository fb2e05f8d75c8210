"""The native library's interface (cpu_worker/native/dovetail.h, library.py): the header declares
what the C files export and library.py declares it with the same arity; a fresh build passes the
ABI check; a stale cached library is rebuilt; a library and a Python mirror that disagree give
one clear line naming what differs."""

from __future__ import annotations

import ctypes
import logging
import re
import shlex
import sys
from pathlib import Path

import pytest

from cpu_worker.native import library as native_library
from cpu_worker.native.library import AbiMismatch

# A declaration or definition of an exported function: its name and its parameter list.
FUNCTION = re.compile(r"^(?:int|void|int64_t|float) (dovetail_\w+)\(([^)]*)\)", re.MULTILINE)


def real_compiler() -> str:
    found = native_library.find_compiler()
    assert found is not None, "no C compiler: the native library cannot be built"
    return found


# A compiler command line that really compiles each distinct command once per session and copies that
# library for a repeat: these tests are about the cache, the ABI check and rebuilding, and a full
# build of the kernels takes ~6 s (a dozen of them was over a minute of the suite).
MEMO_CC = """
import hashlib, os, shutil, subprocess, sys
store, args = sys.argv[1], sys.argv[2:]
out = args.index("-o") + 1
key = hashlib.sha256("\\0".join(args[:out] + args[out + 1:]).encode()).hexdigest()[:24]
kept = os.path.join(store, key + ".so")
if not os.path.exists(kept):
    done = subprocess.run([*args[:out], kept + ".part", *args[out + 1:]])
    if done.returncode:
        sys.exit(done.returncode)
    os.replace(kept + ".part", kept)
shutil.copyfile(kept, args[out])
"""


@pytest.fixture(scope="module")
def memo_cc(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("memo-cc")
    (folder / "memo_cc.py").write_text(MEMO_CC)
    return shlex.join([sys.executable, str(folder / "memo_cc.py"), str(folder), *shlex.split(real_compiler())])


def declared() -> dict[str, int]:
    """dovetail.h's functions and their parameter counts."""
    text = native_library.HEADER.read_text()
    return {name: 0 if params.strip() == "void" else params.count(",") + 1 for name, params in FUNCTION.findall(text)}


def test_the_header_declares_every_exported_function_and_library_py_each_with_its_arity():
    defined = {name for source in native_library.SOURCES for name, _ in FUNCTION.findall(source.read_text())}
    header = declared()
    assert defined == set(header), "dovetail.h and the C files' exported functions differ"
    assert set(native_library.SIGNATURES) == set(header), "library.py's SIGNATURES and dovetail.h differ"
    for name, (argtypes, _) in native_library.SIGNATURES.items():
        assert len(argtypes) == header[name], name
    assert all('#include "dovetail.h"' in source.read_text() for source in native_library.SOURCES)


def test_the_header_s_constants_are_library_py_s():
    defines = dict(re.findall(r"#define DOVETAIL_(\w+) \(?(-?\d+)\)?", native_library.HEADER.read_text()))
    assert defines.pop("ABI_VERSION") == str(native_library.ABI_VERSION)
    assert defines and {name: int(value) for name, value in defines.items()} == {
        name: getattr(native_library, name) for name in defines}


def test_a_fresh_build_passes_the_abi_check(tmp_path, memo_cc):
    library = native_library.build(memo_cc, native_library.FLAGS, tmp_path)
    assert native_library.abi_problem(library) is None
    info = native_library.AbiInfo()
    assert library.dovetail_abi(ctypes.byref(info), ctypes.sizeof(info)) == ctypes.sizeof(info)
    assert info.version == native_library.ABI_VERSION and info.layer_size == ctypes.sizeof(native_library.Layer)
    assert library.dovetail_abi(ctypes.byref(info), ctypes.sizeof(info) - 8) == ctypes.sizeof(info)  # refused


def test_an_older_build_s_shorter_report_is_read_as_a_prefix():
    """An older build's dovetail_abi fills its own, shorter dovetail_abi_info (fields are only ever added at
    the end): its fields are read, the loader refuses it, and a longer or odd report is one line."""
    full = native_library.AbiInfo(**native_library.expected_abi())

    class OlderBuild:
        def __init__(self, fields: int):
            self.fields = fields

            def dovetail_abi(info, size):  # as abi.c: fills *info only when size is its own sizeof
                if size == 8 * self.fields:
                    ctypes.memmove(info, ctypes.byref(full), size)
                return 8 * self.fields
            self.dovetail_abi = dovetail_abi

    fields = native_library._ABI_FIELDS
    older = native_library.read_abi(OlderBuild(25))  # type: ignore[arg-type]
    assert isinstance(older, dict) and list(older) == list(fields[:25])
    assert older == {name: native_library.expected_abi()[name] for name in fields[:25]}
    assert native_library.abi_problem(OlderBuild(25)) == f"it reports no {fields[25]} (an older dovetail_abi_info)"  # type: ignore[arg-type]
    assert native_library.read_abi(OlderBuild(len(fields))) == native_library.expected_abi()  # type: ignore[arg-type]
    for fields_reported in (len(fields) + 1, 0):
        problem = native_library.read_abi(OlderBuild(fields_reported))  # type: ignore[arg-type]
        assert isinstance(problem, str) and "bytes in the library" in problem


def test_a_library_of_another_abi_version_is_one_clear_line(tmp_path, memo_cc):
    flags = [*native_library.FLAGS, "-DDOVETAIL_ABI_VERSION=99"]
    with pytest.raises(AbiMismatch) as raised:
        native_library.build(memo_cc, flags, tmp_path)
    message = str(raised.value)
    assert f"version is 99 in the library, {native_library.ABI_VERSION} in library.py" in message
    assert "\n" not in message


@pytest.mark.parametrize("stale", ["another version", "no report"])
def test_a_stale_cached_library_is_rebuilt(tmp_path, caplog, memo_cc, stale):
    """A file at the cache's name that fails the check (built with another ABI version, or from
    sources without dovetail_abi) is replaced by a fresh build, which this process then loads."""
    cc = memo_cc
    target = native_library.target_path(cc, native_library.FLAGS, tmp_path)
    if stale == "another version":
        native_library.compile_library(cc, [*native_library.FLAGS, "-DDOVETAIL_ABI_VERSION=99"],
                                       native_library.SOURCES, target)
    else:
        native_library.compile_library(cc, native_library.FLAGS, [native_library.DIRECTORY / "fp32_rows.c"], target)
    assert native_library.abi_problem(ctypes.CDLL(str(target))) is not None
    with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
        library = native_library.build(cc, native_library.FLAGS, tmp_path)
    assert "rebuilding it" in caplog.text
    assert ("version is 99 in the library" if stale == "another version" else "no dovetail_abi") in caplog.text
    assert native_library.abi_problem(library) is None and library.dovetail_int8_simd() >= 0
    assert [path.name for path in tmp_path.iterdir()] == [target.name]  # the fresh file, no private copy left
    fresh = tmp_path / "fresh" / "copy.so"  # the file itself passes now (a copy: this name is loaded already)
    fresh.parent.mkdir()
    fresh.write_bytes(target.read_bytes())
    assert native_library.abi_problem(ctypes.CDLL(str(fresh))) is None


def test_a_cached_file_that_is_no_library_is_rebuilt(tmp_path, caplog, memo_cc):
    """A truncated or overwritten file at the cache's name failed to load (OSError), and load()
    took that for a failed build: torch's slower paths at every start, never rebuilt."""
    cc = memo_cc
    target = native_library.target_path(cc, native_library.FLAGS, tmp_path)
    target.write_bytes(b"\x7fELF truncated")  # (an empty file fails to load the same way: one build is enough)
    with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
        library = native_library.build(cc, native_library.FLAGS, tmp_path)
    assert "cannot be loaded" in caplog.text and "rebuilding it" in caplog.text
    assert native_library.abi_problem(library) is None and library.dovetail_int8_simd() >= 0
    assert target.stat().st_size > 1000 and [path.name for path in tmp_path.iterdir()] == [target.name]


class _WiderShape(ctypes.Structure):
    _fields_ = [*native_library.Shape._fields_, ("extra", ctypes.c_int64)]


def test_a_mirror_that_disagrees_with_the_sources_is_rebuilt_once_then_one_clear_line(tmp_path, monkeypatch, caplog,
                                                                                        memo_cc):
    cc = memo_cc
    native_library.build(cc, native_library.FLAGS, tmp_path)  # a good library in the cache
    monkeypatch.setattr(native_library, "Shape", _WiderShape)
    compiled: list[Path] = []
    compile_library = native_library.compile_library
    monkeypatch.setattr(native_library, "compile_library",
                        lambda *args: compiled.append(args[-1]) or compile_library(*args))
    with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"), pytest.raises(AbiMismatch) as raised:
        native_library.build(cc, native_library.FLAGS, tmp_path)
    size = ctypes.sizeof(native_library.Shape)
    assert len(compiled) == 1 and "rebuilding it" in caplog.text
    message = str(raised.value)
    assert f"shape_size is {size - 8} in the library, {size} in library.py" in message and "\n" not in message


def test_load_raises_a_mismatch_rather_than_falling_back(tmp_path, monkeypatch, memo_cc):
    """A compiler that fails is a fallback to torch's paths; a library that disagrees with its
    Python is a broken installation, said as such."""
    monkeypatch.setenv("CC", memo_cc)
    monkeypatch.setenv(native_library.KERNEL_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(native_library, "ABI_VERSION", native_library.ABI_VERSION + 1)
    native_library.clear_cache()
    try:
        with pytest.raises(AbiMismatch, match="version is"):
            native_library.load()
    finally:
        native_library.clear_cache()


def test_an_unwritable_kernel_cache_builds_in_a_temporary_folder(tmp_path, monkeypatch, caplog, memo_cc):
    """HOME (or the cache variable) where nothing can be written: the kernels were not built at all,
    so fp32 trees were verified only to float tolerance and a CPU draft at q4_0 could not start."""
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "kernels"  # under a file (a cache that is itself a file fails alike: one build)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("CC", memo_cc)
    monkeypatch.setenv(native_library.KERNEL_DIR_VARIABLE, str(cache))
    monkeypatch.setattr(native_library.tempfile, "tempdir", str(scratch))
    native_library.clear_cache()
    try:
        with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
            library = native_library.load()
    finally:
        native_library.clear_cache()
    assert library is not None and native_library.abi_problem(library) is None
    assert "cannot write the kernel cache" in caplog.text and "failed" not in caplog.text
    assert list(scratch.iterdir()) == []  # the temporary build is gone once loaded


def test_the_kernel_cache_follows_the_other_caches(tmp_path, monkeypatch):
    """XDG_CACHE_HOME or DOVETAIL_CACHE_DIR moved the cost caches but not the kernels, which still
    went to ~/.cache (a read-only home in a container: no kernels)."""
    monkeypatch.delenv(native_library.KERNEL_DIR_VARIABLE, raising=False)
    monkeypatch.delenv("DOVETAIL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_library.cache_dir() == tmp_path / "xdg" / "dovetail" / "kernels"
    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path / "mine"))
    assert native_library.cache_dir() == tmp_path / "mine" / "kernels"
    monkeypatch.setenv(native_library.KERNEL_DIR_VARIABLE, str(tmp_path / "kernels"))
    assert native_library.cache_dir() == tmp_path / "kernels"


def test_a_cc_of_several_words_builds(tmp_path, monkeypatch, memo_cc):
    """CC="ccache gcc" or "gcc -m64" (make splits it): the whole string was run as one program's name,
    FileNotFoundError, and every kernel fell back to torch's paths."""
    monkeypatch.setenv("CC", f"env {memo_cc}")  # env, python, its script, a folder, then the compiler's words
    monkeypatch.setenv(native_library.KERNEL_DIR_VARIABLE, str(tmp_path))
    native_library.clear_cache()
    try:
        library = native_library.load()
    finally:
        native_library.clear_cache()
    assert library is not None and native_library.abi_problem(library) is None


@pytest.mark.parametrize("cc", ['gcc "unclosed', "   "])
def test_a_cc_that_is_no_command_line_is_a_failed_build_not_a_crash(tmp_path, monkeypatch, caplog, cc):
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv(native_library.KERNEL_DIR_VARIABLE, str(tmp_path))
    native_library.clear_cache()
    try:
        with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
            assert native_library.load() is None
    finally:
        native_library.clear_cache()
    assert "failed" in caplog.text and ("not a command line" in caplog.text or "CC is blank" in caplog.text)
