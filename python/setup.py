"""Builds the epjit package with libepjit.so inside it.

Where the library comes from, in order:
  EPJIT_LIB=/path/libepjit.so     that file;
  EPJIT_BUILD_DIR=/path/build     a configured epjit build tree: runs
                                  `make built-sources libepjit.la` there;
  pkg-config epjit                an installed libepjit (its libdir);
  the source tree above python/   autoreconf (when there is no configure),
                                  configure and make in build-python/.
The C prerequisites are those of doc/building.md (a C compiler, autotools
when building from git, jansson, xxhash, BLAS).
"""

import glob
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(cmd, cwd):
    print("epjit setup: (cd %s && %s)" % (cwd, " ".join(cmd)), flush=True)
    subprocess.check_call(cmd, cwd=cwd)


def _make_lib(build):
    jobs = os.environ.get("EPJIT_MAKE_JOBS", "2")
    _run(["make", "-j" + jobs, "built-sources"], build)
    _run(["make", "-j" + jobs, "libepjit.la"], build)
    lib = os.path.join(build, ".libs", "libepjit.so")
    if not os.path.exists(lib):
        raise RuntimeError("epjit setup: %s was not built (configured "
                           "with --disable-shared?)" % lib)
    return lib


def _pkg_config_lib():
    try:
        libdir = subprocess.check_output(
            ["pkg-config", "--variable=libdir", "epjit"],
            stderr=subprocess.DEVNULL).decode().strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    lib = os.path.join(libdir, "libepjit.so")
    return lib if os.path.exists(lib) else None


def _source_tree_lib():
    if not os.path.exists(os.path.join(ROOT, "configure.ac")):
        raise RuntimeError(
            "epjit setup: no libepjit found: set EPJIT_LIB to libepjit.so, "
            "EPJIT_BUILD_DIR to a configured build tree, install epjit "
            "(pkg-config epjit), or install from the epjit source tree")
    if not os.path.exists(os.path.join(ROOT, "configure")):
        _run(["autoreconf", "-fi"], ROOT)
    build = os.path.join(ROOT, "build-python")
    os.makedirs(build, exist_ok=True)
    if not os.path.exists(os.path.join(build, "Makefile")):
        _run([os.path.join(ROOT, "configure"), "-q", "--disable-static"],
             build)
    return _make_lib(build)


def find_lib():
    env = os.environ.get("EPJIT_LIB")
    if env:
        if not os.path.exists(env):
            raise RuntimeError("epjit setup: EPJIT_LIB=%s: no such file"
                               % env)
        return env
    build = os.environ.get("EPJIT_BUILD_DIR")
    if build:
        return _make_lib(os.path.abspath(build))
    return _pkg_config_lib() or _source_tree_lib()


class BuildPy(build_py):
    def run(self):
        super().run()
        lib = os.path.realpath(find_lib())
        dest = os.path.join(self.build_lib, "epjit", "lib")
        os.makedirs(dest, exist_ok=True)
        for old in glob.glob(os.path.join(dest, "*.so")):
            os.remove(old)
        shutil.copyfile(lib, os.path.join(dest, "libepjit.so"))
        print("epjit setup: shipping %s" % lib, flush=True)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # the wheel holds a shared library
        return True


setup(cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution)
