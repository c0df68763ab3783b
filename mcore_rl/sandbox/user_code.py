"""The user's own code in a sandbox session, loaded as Python would load it.

A reward function, an environment or a tool is trusted code the user wrote: in a module beside
their script, in a folder they put on `sys.path`, in a package installed editable, or in the
script (or notebook) itself. Sessions are forked from a zygote started with `python -c`, so
two things do not come for free:
- **The main module.** The zygote's `__main__` is its boot line, not the user's script, and
  re-running the script there (what multiprocessing's spawn does) would import torch into
  every session's address space, or start training again where the script lacks a
  `if __name__ == "__main__":` guard. So what the sessions need from `__main__` (the
  functions and classes named by the job) travels by value (cloudpickle, which carries the
  helpers and constants they use too) and is bound into the zygote's own `__main__` under the
  same names: a pickle of `__main__.my_score` and a reference "__main__:MyEnv" resolve there
  as in the rank.
- **The folders the code lives in.** Landlock lets a session read only what the zygote named:
  every folder on the rank's `sys.path` and every package the rank imported from outside them
  (an editable install's finder puts none on the path), each whole and read-only, so that a
  module may read the data file beside it (model-written code reads none of it: the python
  tool's interpreter has a Landlock domain of its own). Under root the sessions run as nobody, who may not
  enter a folder only root may (/root, a mkdtemp folder): there the zygote stays root and says
  so (zygote.py, step 2) rather than fail the user's import.

What is named by "module:name" (an environment, a tool) must have such a name: a nested class or
a lambda is refused when the job is built (`check_sendable`), naming it and what to do instead.
What is sent as an object (a `reward_fn`) goes by cloudpickle (`pickle_by_value`): lambdas,
closures and partials too.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Iterable

MAIN = "__main__"


def check_sendable(value: Any, role: str) -> None:
    """ValueError naming `role` (e.g. "reward_fn") when `value` cannot reach a sandbox session:
    it has no module-level name there, or, defined in the main module, cannot be pickled by
    value."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if module is None or qualname is None:
        raise ValueError(f"{role} {value!r} is not a function or class: pass a function or "
                         "class defined at the top level of a module or of your script")
    if "<lambda>" in qualname or "<locals>" in qualname or _lookup(module, qualname) is not value:
        kind = "a lambda" if "<lambda>" in qualname else (
            "defined inside a function" if "<locals>" in qualname else
            f"not reachable as {module}.{qualname}")
        raise ValueError(f"{role} {module}.{qualname} is {kind}: sandboxed processes load it by "
                         "its module and name, so define it at the top level of your script "
                         "or of a module (a def, not a lambda or a nested function)")
    if module == MAIN:
        pickle_by_value(value, role)


def pack_main_objects(values: Iterable[Any]) -> bytes:
    """The main module's `values` as one payload {qualified name: object} for
    `bind_main_objects`."""
    objects = {value.__qualname__: value for value in values}
    return pickle_by_value(objects, ", ".join(f"{MAIN}.{name}" for name in objects))


def pickle_by_value(value: Any, role: str) -> bytes:
    """`value` pickled by cloudpickle: what a module can import goes by reference, the rest (the
    main module's functions and classes, lambdas, closures) by value; ValueError naming `role`
    when it cannot be pickled (it holds a lock, a socket, an open file...)."""
    import cloudpickle

    try:
        return cloudpickle.dumps(value)
    except Exception as error:
        raise ValueError(f"{role} cannot be sent to the sandboxed processes "
                         f"({type(error).__name__}: {error}): what it uses must pickle; or "
                         "move it into a module of its own") from error


def bind_main_objects(payload: bytes) -> None:
    """In the zygote: put the rank's main-module objects into this process's `__main__`."""
    for name, value in pickle.loads(payload).items():
        setattr(sys.modules[MAIN], name, value)


def code_folders() -> list[str]:
    """Where the user's code may be loaded from, as real paths: every folder on `sys.path`, and
    each imported top-level package's folder (or module's file) that none of them holds (an
    editable install's); none inside the Python installation (the sandbox reads it whole).
    Call in the rank."""
    python = {os.path.realpath(prefix) for prefix in (sys.prefix, sys.base_prefix,
                                                      sys.exec_prefix, sys.base_exec_prefix)}
    folders = {os.path.realpath(entry or os.getcwd()) for entry in sys.path}
    places = {folder for folder in folders if os.path.isdir(folder)
              and not any(beneath(folder, root) for root in python)}
    for name, module in list(sys.modules.items()):
        location = getattr(module, "__file__", None)
        if "." in name or not location:
            continue
        location = os.path.realpath(location)
        if os.path.basename(location).startswith("__init__."):
            location = os.path.dirname(location)  # a package: its folder
        if not any(beneath(location, place) for place in (*places, *python)):
            places.add(location)
    return sorted(places)


def beneath(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies inside it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _lookup(module: str, qualname: str) -> Any:
    target = sys.modules.get(module)
    for attribute in qualname.split("."):
        target = getattr(target, attribute, None)
    return target
