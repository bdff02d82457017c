"""Build script for dcp_optim and its required C core, dcp_optim._dcp_optim.

Only setuptools and the Python headers are needed: the extension uses the
CPython C API alone and never includes or links torch.

Build profiles (environment variables, read at build time):

  (none)                release: -O2, NDEBUG, strict warnings
  DCP_OPTIM_DEBUG=1     -O0 -g3 with C asserts enabled
  DCP_OPTIM_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer
  DCP_OPTIM_COVERAGE=1  gcov instrumentation
  DCP_OPTIM_WERROR=1    turn warnings into errors (CI and the Makefile set it)
"""

import os
import sys
from glob import glob

from setuptools import Extension, setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "no")


WARNINGS = [
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-Wformat=2",
    "-Wundef",
    "-Wvla",
    "-Wcast-function-type",
    "-Wsign-compare",
    "-Wimplicit-fallthrough",
    "-Werror=implicit-function-declaration",
]

compile_args = ["-std=c11", *WARNINGS]
link_args: list[str] = []
undef_macros: list[str] = []

if _flag("DCP_OPTIM_WERROR"):
    compile_args.append("-Werror")
if _flag("DCP_OPTIM_DEBUG"):
    compile_args += ["-O0", "-g3"]
    undef_macros.append("NDEBUG")
elif _flag("DCP_OPTIM_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
           "-fno-sanitize-recover=undefined"]
    compile_args += ["-O1", "-g", *san]
    link_args += san
    undef_macros.append("NDEBUG")
else:
    compile_args += ["-O2", "-g0"]
if _flag("DCP_OPTIM_COVERAGE"):
    compile_args += ["--coverage", "-O0"]
    link_args += ["--coverage"]

if sys.platform == "win32":  # MSVC understands none of the GCC flags.
    compile_args, link_args = [], []

core = Extension(
    "dcp_optim._dcp_optim",
    sources=sorted(glob("csrc/*.c")),
    depends=sorted(glob("csrc/*.h")),
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    undef_macros=undef_macros,
    optional=False,  # there is no pure-Python fallback
)

setup(ext_modules=[core])
