"""``@native_op``, the wrapper every function of _plan_ops.py, _dropin_ops.py, _chunk_ops.py and
_quant_ops.py shares. A function is written as its unique part, a body that sizes and allocates
the op's outputs; the decorator makes the public function around ``padmoe._C.<name>_out``:

    @native_op(outputs="y", keywords=PADDED)
    def dispatch(c, x: Array, plan: Plan, weights: Optional[Array] = None) -> Array:
        \"\"\"The public docstring.\"\"\"
        c.y = _padded_out(c.arrays, c.op, x, c.rows, c.y, _bound_rows(plan, c.op))

The public function has the body's name and docstring, and as parameters the body's after ``c``
followed by the ``keywords`` options (OPTIONS) the body does not declare itself, keyword-only, in
that order. A call runs these steps, in the order the ops check their arguments (with several bad
arguments, the error is the one the op raised first):

1. ``before(c)``, when given: checks of arguments that are not arrays;
2. the framework of each argument named in ``arrays`` (default: the first parameter), a TypeError
   naming it otherwise. The first one's is the outputs' framework (``c.arrays``) and that argument
   the array the op runs by (``c.like``: device, stream). ``numpy_only`` (the padmoe.torch way, for
   the error): a torch tensor there is a TypeError;
3. ``out=`` split into the named ``outputs``: one array, or a tuple of that many entries;
4. the array arguments (annotated ``Array``) and outputs made ready for the native module
   (_arrays.prepare: a torch tensor that requires grad is detached, the same memory);
5. ``body(c, <its arguments>)``: it allocates the outputs still None (``c.<output> = ...``). The
   native options ``c.opts`` (_common._options) are made when first read: a body reads them first
   when the op checks them before it sizes its outputs;
6. ``_C.<name>_out(<the positional arguments>, <the outputs>, **c.opts)``, an array named
   ``*_scales`` as _common._native_scales passes it; the outputs are returned (one, or a tuple).
   A body whose native call has another shape makes the call itself and returns the result.

``c`` holds every argument and output by name, besides ``op`` (the function's name), ``arrays``,
``like`` and ``opts``; an option the function does not take holds its default.
"""

from __future__ import annotations

import inspect
from operator import itemgetter
from typing import Callable, Optional

from ._arrays import NUMPY, arrays_of
from ._common import _C, _UNSET, _native_scales, _options, _split_out, _weight_grad
from ._common import numpy_only as _numpy_only

# The options the ops share (_common's docstring): name -> (default, annotation). The annotations
# are text, as in modules with `from __future__ import annotations`; out's is Optional[<the result>].
OPTIONS = {
    "check": (None, "Optional[bool]"),
    "zero_padding": (True, "bool"),
    "rows": (None, "Optional[int]"),
    "out": (None, None),
    "num_threads": (0, "int"),
    "workspace": (None, "Optional[Array]"),
    "stream": (None, "Optional[int]"),
}
PADDED = ("check", "zero_padding", "rows", "out", "num_threads", "workspace", "stream")  # a padded output
PADDED_GRAD = ("check", "rows", "out", "num_threads", "workspace", "stream")  # a gradient's: padding is zero
PLAIN = ("check", "out", "num_threads", "workspace", "stream")
NO_OUT = ("check", "num_threads", "workspace", "stream")

_ARRAY = ("Array", "Optional[Array]")
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


class Call:
    """One call of a public function: the ``c`` of its body. Its attributes are the dict the call's
    arguments came in (no copy: at decode sizes a call's host time counts)."""

    def __init__(self, values: dict):
        self.__dict__ = values

    @property
    def opts(self) -> dict:
        """The native op's keyword options: one dict for the call (checked_rows may turn its check off)."""
        if self._opts is None:
            self._opts = _options(
                self.arrays,
                self.like,
                self.check,
                self.num_threads,
                self.workspace,
                self.stream,
                self.zero_padding,
                self._given,
            )
        return self._opts

    def weight_grad(self, weights, count: int):
        """The weight-gradient output (the last output): the entry of ``out=`` (None skips it), else a
        new array of ``weights``' dtype when weights were given, else None."""
        given = getattr(self, self._outputs[-1]) if self.out is not None else _UNSET
        return _weight_grad(self.arrays, self.like, weights, given, count)


_TAKEN = {"op", "arrays", "like", "opts", "weight_grad", "_opts", "_outputs", "_given"}


def native_op(
    outputs: str = "",
    keywords: tuple = PLAIN,
    arrays: Optional[str] = None,
    numpy_only: Optional[str] = None,
    before: Optional[Callable[[Call], None]] = None,
):
    """The public function of the body it decorates (the module's docstring). ``outputs`` and
    ``arrays`` are names separated by spaces; ``arrays=""`` looks up no framework and prepares
    nothing, for a function that passes its arguments on to another. ``keywords``: names of OPTIONS,
    or (name, default, annotation) for a keyword-only option of the op's own."""
    outputs = tuple(outputs.split())

    def wrap(body):
        op = body.__name__
        signature = inspect.signature(body)
        own = list(signature.parameters.values())[1:]
        result = signature.return_annotation
        added = [_keyword(k, result) for k in keywords]
        params = own + [p for p in added if p.name not in signature.parameters]
        names = [p.name for p in params]
        new = [n for n in outputs if n != "out" or len(outputs) > 1]  # a lone output named out is out= itself
        twice = (set(names) | set(new)) & _TAKEN | set(names) & set(new)
        assert not twice, f"{op}: {sorted(twice)}: each name must be one argument, output or Call attribute"
        assert "out" in names or not outputs, f"{op}: outputs come with out="
        framed = tuple(arrays.split()) if arrays is not None else tuple(names[:1])
        first = framed[0] if framed else None
        ready = [p.name for p in own if p.annotation in _ARRAY and p.name not in framed] + list(outputs)
        positional = _getter([p.name for p in own if p.kind is _POSITIONAL])
        keyword = tuple(p.name for p in own if p.kind is _KEYWORD)
        keyword_values = _getter(keyword)
        native_names = [p.name for p in params if p.kind is _POSITIONAL] + list(outputs)
        scales = [i for i, n in enumerate(native_names) if n.endswith("_scales")]
        native_args = _getter(native_names)
        results = _getter(outputs)
        native_name = op + "_out"
        padded = "rows" in names  # a padded output: one from out= keeps its rows at or past P
        # What a call's dict holds besides the arguments: the options the function does not take, and
        # the call's own state.
        start = {n: OPTIONS[n][0] for n in OPTIONS if n not in names}
        start.update(op=op, _outputs=outputs, arrays=None, like=None, _opts=None, _given=False)

        def run(values: dict):
            values.update(start)
            c = Call(values)
            if before is not None:
                before(c)
            for n in framed:
                a = values[n]
                framework = _numpy_only(op, n, a, numpy_only) if numpy_only and n == first else arrays_of(a, op, n)
                if n == first:
                    values["arrays"] = framework
                values[n] = framework.prepare(a)
            if len(outputs) == 1:
                values[outputs[0]] = values["out"]
            elif outputs:
                values.update(zip(outputs, _split_out(op, values["out"], len(outputs))))
            if first is not None:
                framework = values["arrays"]
                if framework is not NUMPY:  # (a numpy array is ready as it is)
                    for n in ready:
                        if values[n] is not None:
                            values[n] = framework.prepare(values[n])
                values["like"] = values[first]
                if padded:
                    values["_given"] = values[outputs[0]] is not None
            if keyword:
                done = body(c, *positional(values), **dict(zip(keyword, keyword_values(values))))
            else:
                done = body(c, *positional(values))
            if done is not None:
                return done
            args = native_args(values)
            if scales:
                args = list(args)
                for i in scales:
                    args[i] = _native_scales(c.arrays, args[i])
            getattr(_C, native_name)(*args, **c.opts)
            return results(values) if len(outputs) > 1 else values[outputs[0]]

        fn = _function(op, body.__module__, params, result, run)
        fn.__doc__ = body.__doc__
        return fn

    return wrap


def _keyword(option, result) -> inspect.Parameter:
    """A keyword-only parameter: a name of OPTIONS, or a (name, default, annotation) of the op's own."""
    name, default, annotation = (option, *OPTIONS[option]) if isinstance(option, str) else option
    return inspect.Parameter(name, _KEYWORD, default=default, annotation=annotation or f"Optional[{result}]")


def _getter(names):
    """A function of a call's dict that gives the values of ``names`` as a tuple (at C speed)."""
    if len(names) == 1:
        name = names[0]
        return lambda values: (values[name],)
    return itemgetter(*names) if names else lambda values: ()


def _function(name: str, module: str, params: list, result, run: Callable[[dict], object]):
    """A function ``name(<params>)`` that returns ``run(<its arguments by name>)``, made from source
    as the dataclasses module makes its methods. A real def: a call binds its arguments at C speed
    (inspect.Signature.bind costs several µs, as much as the rest of a small dispatch call), a wrong
    call gets Python's own TypeError, and help() and inspect show the signature."""
    text, star = [], False
    for p in params:
        if p.kind is _KEYWORD and not star:
            text.append("*")
            star = True
        text.append(p.name if p.default is p.empty else f"{p.name}=_defaults[{p.name!r}]")
    source = f"def {name}({', '.join(text)}):\n    return _run(locals())\n"
    namespace = {"_run": run, "_defaults": {p.name: p.default for p in params}}
    exec(compile(source, f"<native_op {module}.{name}>", "exec"), namespace)
    fn = namespace[name]
    fn.__module__ = module
    fn.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
    fn.__annotations__["return"] = result
    return fn
