"""Finds the torch that padmoe's torch operators are built against (CMakeLists.txt, padmoe_torch_ops()).

Run by the build's Python. Under pip's build isolation (the default of `pip install .`) that is
the interpreter of the environment padmoe is being installed into, with the environment's
site-packages hidden behind the isolated build requirements. When torch is not importable as
it is, this looks for it in that environment's own site-packages (sysconfig / site give them
even under isolation), then in $VIRTUAL_ENV's, and imports it from there: the operators are
built against the torch padmoe will run with, and no second torch enters the build.

Prints KEY=VALUE lines (INCLUDE is a CMake list); exit status 1 when no torch is found, with
LOOKED (the directories searched) and ERROR.
"""

import os
import site
import sys
import sysconfig


def _candidates():
    dirs = []
    paths = sysconfig.get_paths()
    dirs += [paths.get("purelib"), paths.get("platlib")]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # an old virtualenv's site.py
        pass
    if sys.prefix == sys.base_prefix:  # no virtual environment: the user's site-packages too (pip hides it)
        try:
            dirs.append(site.getusersitepackages())
        except AttributeError:
            pass
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:  # an activated environment, when the build runs in a virtual environment of its own
        dirs.append(os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2], "site-packages"))
    seen, out = set(), []
    for d in dirs:
        if d and os.path.normcase(os.path.abspath(d)) not in seen:
            seen.add(os.path.normcase(os.path.abspath(d)))
            out.append(d)
    return out


def _import_torch():
    looked = ["the build's sys.path"]
    try:
        import torch

        return torch, "", looked
    except ImportError as e:
        error = str(e)
    for d in _candidates():
        if not os.path.isdir(d):
            continue
        looked.append(d)
        if not os.path.isdir(os.path.join(d, "torch")):
            continue
        site.addsitedir(d)  # appended: the build requirements keep their place in front
        for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
            del sys.modules[name]
        try:
            import torch

            return torch, d, looked
        except ImportError as e:
            error = "%s: %s" % (d, e)
    return None, error, looked


def main():
    torch, where, looked = _import_torch()
    if torch is None:
        print("LOOKED=" + ";".join(looked))
        print("ERROR=" + where.replace("\n", " "))
        return 1
    root = os.path.dirname(torch.__file__)
    try:
        import torch.utils.cpp_extension as ext

        include = ext.include_paths()
    except Exception:  # cpp_extension imports setuptools, which an environment may lack
        include = [os.path.join(root, "include"), os.path.join(root, "include", "torch", "csrc", "api", "include")]
    print("INCLUDE=" + ";".join(include))
    print("LIB=" + os.path.join(root, "lib"))
    print("ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
    print("CUDA=" + (torch.version.cuda or ""))
    print("VERSION=" + torch.__version__)
    print("PATH=" + root)
    print("SITE=" + where)  # empty: importable by the build's Python as it is
    return 0


if __name__ == "__main__":
    sys.exit(main())
