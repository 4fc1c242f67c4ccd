"""The attention sublayer around one scaled_dot_product_attention call, found by structure and proved
position-wise, as the programs runtime/attention_blocks.py walks in query blocks and key tiles.

The query path is every node the call's query is computed from that the key and value are not (torchtitan's MLA:
the low-rank q projection, its norm, the split, RoPE; GQA: the q projection, q_norm, RoPE; a fused q/k/v projection
leaves only what follows its split); the key / value path likewise every node key and value are computed from that
the query is not. Their inputs are the weights they read and the tensors they share with the rest of the block (the
normed hidden states, the RoPE table's rows): the *row inputs*, each with one sequence dim. The output path is the
chain from the call's output through reshapes and slices to the first linear (the output projection), every link
used once.

Every path must be position-wise along the sequence, or walking it in blocks would change what it computes. Each node
is checked by a rule that follows the sequence dim through it (``_Follow``): linear maps and elementwise ops keep it
(broadcast operands aligned on it), reshapes keep it when the dims before it are unchanged, splits, concatenations,
slices and norms act on other dims only, transposes / permutes / flattens move it. A node no rule covers, or one that
would mix positions, leaves the sublayer to the call alone (the region's reason names it). Shapes in a Dynamo graph
are literal ints: the sequence length in a reshape's target is rewritten to the block's row count ``n``, the
programs' first input; every other int stays, and a program that still makes a sequence-long dim at a block's rows
fails when the region is registered (its programs run on a few fake rows there), which refuses the rewrite too.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.passes.graph_edit import ancestors
from boundpass.passes.graph_edit import example_value as _val


class NotPositionwise(Exception):
    """Why a path cannot be walked in query blocks."""


_ELEMENTWISE_FUNCTIONS = {operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
                          torch.mul, torch.add, torch.sub, torch.div, torch.neg, torch.rsqrt, torch.exp, torch.sigmoid,
                          torch.tanh, torch.sqrt, torch.pow, torch.sin, torch.cos, F.silu, F.gelu, F.relu}
_ELEMENTWISE_METHODS = {"float", "half", "bfloat16", "double", "type_as", "to", "contiguous", "clone", "mul", "add",
                        "sub", "div", "neg", "pow", "rsqrt", "sigmoid", "exp", "__neg__", "__mul__", "__add__",
                        "type"}
_LINEAR = {torch._C._nn.linear, F.linear}
_RESHAPES = {"view", "reshape"}
_NORMS = {torch.rms_norm, torch.layer_norm, F.rms_norm, F.layer_norm}
_SPLITS = {torch.split, torch.functional.split, torch.chunk, torch.tensor_split}
_REDUCTIONS = {torch.mean, torch.sum, torch.amax}      # over dims other than the sequence (a hand-written RMSNorm)


def _name(node: fx.Node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _shape(x):
    v = _val(x)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def input_dims(node: fx.Node, length: int) -> list:
    """The sequence dims a region input may have: none for parameters and tensors without a dim of ``length``;
    otherwise none or any dim of that size (a weight or a head dim equal to L as well: ``follow_inputs`` keeps the
    one assignment under which the path is position-wise and q carries the sequence)."""
    value = _val(node)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return [None]
    return [i for i, s in enumerate(value.shape) if s == length] + [None]


class _Follow:
    """Follows the sequence dim through the nodes of a path; notes which int args are the sequence length."""

    def __init__(self, length: int, dims: dict, alias: dict | None = None):
        self.length, self.dims, self.alias = length, dims, alias or {}
        self.literals: dict = {}        # node -> positions in its flattened shape args that are the length

    def dim(self, arg):
        return self.dims.get(self.alias.get(arg, arg)) if isinstance(arg, fx.Node) else None

    def __call__(self, node: fx.Node):
        if node.op not in ("call_function", "call_method"):
            raise NotPositionwise(f"{node.op} {node.name}")
        name, args = _name(node), node.args
        shape = _shape(node)
        if node.op == "call_function" and node.target is operator.getitem and isinstance(_val(args[0]), (tuple, list)):
            d = self.dim(args[0])
            return d[args[1]] if isinstance(d, (tuple, list)) else d
        if node.op == "call_function" and node.target is operator.getitem:
            return self._index(node)
        if node.op == "call_function" and node.target in _LINEAR:
            d = self.dim(args[0])
            if any(self.dim(a) is not None for a in args[1:]) or any(self.dim(a) is not None for a in node.kwargs.values()):
                raise NotPositionwise(f"{node.name}: a linear map whose weight carries the sequence")
            if d is not None and d == len(_shape(args[0])) - 1:
                raise NotPositionwise(f"{node.name}: a linear map along the sequence")
            return d
        if ((node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS)
                or (node.op == "call_method" and name in _ELEMENTWISE_METHODS)):
            return self._broadcast(node, shape)
        if node.op == "call_function" and node.target in _NORMS:
            d, normalized = self.dim(args[0]), args[1]
            if any(self.dim(a) is not None for a in args[2:4]):
                raise NotPositionwise(f"{node.name}: a norm whose weight carries the sequence")
            if d is not None and d >= len(shape) - len(normalized):
                raise NotPositionwise(f"{node.name}: a norm over the sequence")
            return d
        if (node.op == "call_method" and name in _RESHAPES) or (node.op == "call_function"
                                                                and node.target is torch.reshape):
            return self._reshape(node, shape)
        if node.op == "call_method" and name == "expand":
            return self._expand(node, shape)
        if (node.op == "call_method" and name in ("transpose", "permute", "flatten", "unsqueeze", "squeeze")) or \
                (node.op == "call_function" and node.target in (torch.transpose, torch.flatten, torch.unsqueeze)):
            return self._moved(node, name.split(".")[-1], shape)
        if (node.op == "call_function" and node.target in _SPLITS) or (node.op == "call_method"
                                                                       and name in ("split", "chunk")):
            d = self.dim(args[0])
            dim = node.kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if d is not None and _norm_dim(dim, len(_shape(args[0]))) == d:
                raise NotPositionwise(f"{node.name}: a split along the sequence")
            return tuple(d for _ in _val(node))
        if node.op == "call_function" and node.target is torch.cat:
            parts = args[0]
            dim = node.kwargs.get("dim", args[1] if len(args) > 1 else 0)
            ds = {self.dim(p) for p in parts}
            if len(ds) != 1 or (None in ds and len(parts) > 1 and any(s == self.length for p in parts
                                                                          for s in _shape(p))):
                raise NotPositionwise(f"{node.name}: concatenated tensors disagree on the sequence dim")
            d = ds.pop()
            if d is not None and _norm_dim(dim, len(shape)) == d:
                raise NotPositionwise(f"{node.name}: a concatenation along the sequence")
            return d
        if (node.op == "call_function" and node.target in _REDUCTIONS) or (node.op == "call_method"
                                                                           and name in ("mean", "sum", "amax")):
            return self._reduced(node)
        if node.op == "call_function" and node.target in (torch.view_as_complex, torch.view_as_real):
            d = self.dim(args[0])
            if d is not None and node.target is torch.view_as_complex and d == len(_shape(args[0])) - 1:
                raise NotPositionwise(f"{node.name}: the sequence is the complex pair dim")
            return d
        raise NotPositionwise(f"{node.name} ({name}) is not an op the query blocks know to be position-wise")

    def _broadcast(self, node, shape):
        out = None
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(_val(a), torch.Tensor)]
        for a in operands:
            d, s = self.dim(a), _shape(a)
            if d is None:
                continue
            from_right = len(s) - d
            if out is not None and out != from_right:
                raise NotPositionwise(f"{node.name}: operands carry the sequence at different dims")
            out = from_right
        if out is None:
            return None
        for a in operands:
            s = _shape(a)
            if self.dim(a) is None and len(s) >= out and s[len(s) - out] != 1:
                raise NotPositionwise(f"{node.name}: an operand without the sequence is broadcast along it")
        return len(shape) - out

    def _reduced(self, node):
        d = self.dim(node.args[0])
        if d is None:
            return None
        ndim = len(_shape(node.args[0]))
        dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dims is None or isinstance(dims, fx.Node):
            raise NotPositionwise(f"{node.name}: a reduction over every dim, the sequence's too")
        dims = {_norm_dim(x, ndim) for x in (dims if isinstance(dims, (tuple, list)) else (dims,))}
        if d in dims:
            raise NotPositionwise(f"{node.name}: a reduction over the sequence")
        keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
        return d if keep else d - sum(1 for x in dims if x < d)

    def _index(self, node):
        base, index = node.args
        d = self.dim(base)
        if d is None:
            return None
        ndim = len(_shape(base))
        index = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, fx.Node) or not (i is None or i is Ellipsis or isinstance(i, (int, slice)))
               for i in index):
            raise NotPositionwise(f"{node.name}: indexing other than slices, ints and None")
        if Ellipsis in index:
            at = index.index(Ellipsis)
            used = sum(1 for i in index if i is not None and i is not Ellipsis)
            index = index[:at] + (slice(None),) * (ndim - used) + index[at + 1:]
        out, dim = 0, 0      # the output dim and the input dim each index element is at
        for i in index:
            if i is None:    # a new dim of one (repeat_kv's [:, :, None])
                out += 1
                continue
            if dim == d:
                if i != slice(None):
                    raise NotPositionwise(f"{node.name}: an index into the sequence")
                return out
            dim += 1
            out += isinstance(i, slice)
        return out + (d - dim)

    def _reshape(self, node, shape):
        base = node.args[0]
        d = self.dim(base)
        if d is None:
            return None
        before = _shape(base)
        prefix = math.prod(before[:d])
        for j in range(len(shape)):
            if math.prod(shape[:j]) == prefix and shape[j] == self.length:
                self._note_length(node, j)
                return j
        raise NotPositionwise(f"{node.name}: a reshape of {before} to {shape} merges the sequence with another dim")

    def _expand(self, node, shape):
        d = self.dim(node.args[0])
        if d is not None:
            self._note_length(node, d)
        return d

    def _note_length(self, node, position: int) -> None:
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = sizes[0]
        if position < len(sizes) and sizes[position] == self.length:
            self.literals[node] = position

    def _moved(self, node, name, shape):
        base = node.args[0]
        d, ndim = self.dim(base), len(_shape(base))
        if d is None:
            return None
        rest = list(node.args[1:])
        if name == "transpose":
            a, b = (_norm_dim(x, ndim) for x in rest[:2])
            return b if d == a else a if d == b else d
        if name == "permute":
            order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
            return [_norm_dim(x, ndim) for x in order].index(d)
        if name == "unsqueeze":
            at = _norm_dim(rest[0], ndim + 1)
            return d + 1 if at <= d else d
        if name == "flatten":
            start = _norm_dim(rest[0] if rest else node.kwargs.get("start_dim", 0), ndim)
            end = _norm_dim(rest[1] if len(rest) > 1 else node.kwargs.get("end_dim", -1), ndim)
            if start <= d <= end and start != end:
                raise NotPositionwise(f"{node.name}: a flatten merges the sequence with another dim")
            return d if d < start else d - (end - start)
        raise NotPositionwise(f"{node.name}: {name}")


def query_path(sdpa: fx.Node, query: fx.Node, key: fx.Node, value: fx.Node) -> list[fx.Node]:
    """The nodes computing ``query`` that key and value do not need, in graph order; each used only inside."""
    return _path(sdpa, [query], ancestors(key) | ancestors(value) | {key, value}, "query")


def kv_path(sdpa: fx.Node, query: fx.Node, key: fx.Node, value: fx.Node, also_using: set = frozenset()) -> list:
    """The nodes computing ``key`` and ``value`` that the query does not need, in graph order; each used only inside
    (or by ``also_using``: the padding of a value the rewrite drops)."""
    return _path(sdpa, [key, value], ancestors(query) | {query}, "key / value", also_using)


def _path(sdpa: fx.Node, results: list, shared: set, what: str, also_using: set = frozenset()) -> list[fx.Node]:
    path = {n for r in results for n in ancestors(r) | {r}}
    path = [n for n in path if n not in shared and n.op not in ("placeholder", "get_attr")]
    # an item of a tuple made outside (a fused q/k/v projection's split) is where the path starts: an input
    path = [n for n in path if not (n.op == "call_function" and n.target is operator.getitem
                                    and n.args[0] not in path and isinstance(_val(n.args[0]), (tuple, list)))]
    inside = set(path) | {sdpa} | set(also_using)
    for n in path:
        outside = [u for u in n.users if u not in inside]
        if outside:
            raise NotPositionwise(f"{n.name} is used outside the {what} path (by {outside[0].name})")
    order = {n: i for i, n in enumerate(sdpa.graph.nodes)}
    return sorted(path, key=order.__getitem__)


def output_path(sdpa: fx.Node) -> list[fx.Node]:
    """The chain from the call's output to the first linear after it (reshapes and slices between), each link used
    once; empty when no linear follows that way."""
    chain, node = [], sdpa
    while len(node.users) == 1:
        (user,) = node.users
        if user.op not in ("call_function", "call_method"):
            break
        chain.append(user)
        if user.op == "call_function" and user.target in _LINEAR:
            return chain
        reshaping = user.op == "call_method" and _name(user) in ("transpose", "contiguous", "view", "reshape",
                                                                  "flatten", "permute")
        slicing = user.op == "call_function" and user.target is operator.getitem   # a padded value's columns off
        if not (reshaping or slicing):
            break
        node = user
    return []


# what a norm before a region may be made of (it joins the region when only the region reads it)
_NORM_FUNCTIONS = _NORMS | _ELEMENTWISE_FUNCTIONS | _REDUCTIONS
_NORM_METHODS = _ELEMENTWISE_METHODS | {"mean", "sum", "amax"}


def norm_joining(inside: set) -> set:
    """The nodes before ``inside`` that only it reads and that a norm is made of (a norm module's call or a
    hand-written one's elementwise ops and reductions): the norm that joins a region, so that its intermediates
    (an RMSNorm's fp32 copy of its input and normalised product, both saved whole for its backward) exist for a
    block of rows at a time and the region's row input becomes the norm's input, the residual stream."""
    if not inside:
        return set()
    order = {n: i for i, n in enumerate(next(iter(inside)).graph.nodes)}
    grown, changed = set(), True
    while changed:
        changed = False
        both = inside | grown
        for n in inputs_of(sorted(both, key=order.__getitem__)):
            if n in both or n.op in ("placeholder", "get_attr") or not n.users or any(u not in both for u in n.users):
                continue
            if is_norm_op(n):
                grown.add(n)
                changed = True
    return grown


def is_norm_op(n: fx.Node) -> bool:
    """Whether ``n`` is what a norm may be made of: a norm call, or an elementwise op or reduction of a hand-written
    one, with a tensor result."""
    kind = (n.op == "call_function" and n.target in _NORM_FUNCTIONS) or \
        (n.op == "call_method" and n.target in _NORM_METHODS)
    return kind and isinstance(_val(n), torch.Tensor)


def norm_ending_at(node: fx.Node) -> set | None:
    """The nodes of the norm whose result ``node`` is, or None: a norm call (``F.rms_norm`` / ``F.layer_norm``, what
    torchtitan's and PyTorch's modules call), or a hand-written one (HF's ``*RMSNorm``: a cast, a square, a mean over
    the last dim, an rsqrt, products, a cast back), the elementwise ops and reductions only its result reads, with an
    rsqrt and a reduction among them; ``node`` is where the norm ends (some reader is not part of it)."""
    if not is_norm_op(node) or not node.users or all(is_norm_op(u) for u in node.users):
        return None
    nodes = norm_joining({node}) | {node}
    names = {_name(n) for n in nodes}
    if node.target in _NORMS or ("rsqrt" in names and names & {"mean", "sum"}):
        return nodes
    return None


def inputs_of(path: list[fx.Node], *also: fx.Node) -> list[fx.Node]:
    """The nodes outside ``path`` that it reads, in first-use order (``also``: nodes to treat as inside)."""
    inside, out = set(path) | set(also), []
    for n in path:
        for a in n.all_input_nodes:
            if a not in inside and a not in out:
                out.append(a)
    return out


def follow(path: list[fx.Node], length: int, dims: dict, alias: dict | None = None) -> _Follow:
    """Check every node of ``path`` position-wise; ``dims`` (input -> its sequence dim) gains every node's;
    ``alias``: a node read as another (``program``'s)."""
    walker = _Follow(length, dims, alias)
    for n in path:
        dims[n] = walker(n)
    return walker


def follow_inputs(path: list[fx.Node], inputs: list[fx.Node], length: int, results: list,
                  fixed: dict | None = None, alias: dict | None = None) -> tuple[dict, _Follow]:
    """``follow`` under the one assignment of the inputs' sequence dims (``input_dims``) under which every node is
    position-wise and each of ``results`` ((node, dim) pairs) carries the sequence at its dim; refused when none or
    several do."""
    choices = [input_dims(i, length) for i in inputs]
    found, why = [], ""
    for combo in itertools.islice(itertools.product(*choices), 256):
        dims = {**(fixed or {}), **dict(zip(inputs, combo))}
        try:
            walker = follow(path, length, dims, alias)
        except NotPositionwise as e:
            why = why or str(e)
            continue
        wrong = [(r, d) for r, d in results if dims.get(r) != d]
        if not wrong:
            found.append((dims, walker))
        else:
            r, d = wrong[0]
            why = why or f"{r.name} carries the sequence at dim {dims.get(r)}, not {d}"
    if not found:
        raise NotPositionwise(why)
    if len(found) > 1:
        raise NotPositionwise(f"the inputs' sequence dims are ambiguous ({len(found)} consistent assignments)")
    return found[0]


def program(path: list[fx.Node], inputs: list[fx.Node], results, walker: _Follow,
            alias: dict | None = None) -> fx.GraphModule:
    """``path`` as a GraphModule (n, *inputs) -> results (a node or a tuple of them), the sequence length in its
    reshapes replaced by n; ``alias``: a node read as another (a dropped padding read as the value it padded)."""
    graph = fx.Graph()
    n = graph.placeholder("n")
    env = {a: graph.placeholder(f"in{i}") for i, a in enumerate(inputs)}
    alias = alias or {}
    for node in path:
        new = graph.node_copy(node, lambda a: env[alias.get(a, a)])
        if node in walker.literals:
            new.args = _with_length(new.args, walker.literals[node], n)
        env[node] = new
    graph.output(tuple(env[r] for r in results) if isinstance(results, (tuple, list)) else env[results])
    return fx.GraphModule(torch.nn.Module(), graph)


def _with_length(args: tuple, position: int, n: fx.Node) -> tuple:
    base, sizes = args[0], list(args[1:])
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        inner = list(sizes[0])
        inner[position] = n
        return (base, type(sizes[0])(inner))
    sizes[position] = n
    return (base, *sizes)


_PADS = {torch._C._nn.pad, F.pad}


@dataclass
class Padded:
    """A value zero-padded along its head dim for torch's fused kernel, as the call reads it."""
    source: fx.Node     # the value before the padding
    links: list         # the reshapes between the padding and the call, in graph order (the op replays them)
    chain: list         # the call's value argument, down to the padding: what the rewrite erases

    @property
    def pad(self) -> fx.Node:
        return self.chain[-1]


def padded_value(value: fx.Node, opath: list[fx.Node]) -> Padded | None:
    """``value`` as a ``Padded`` when it is a value zero-padded along its head dim to the query's for torch's fused
    kernel (torchtitan on CPU, the MoP layout) and the output path slices the padded columns off again; else None.
    The chunked kernels take a value head dim of its own, so the op reads the narrower value and the slice is a no-op
    on its output."""
    chain, node = [], value
    while node.op == "call_method" and _name(node) in ("transpose", "contiguous") and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    if not (node.op == "call_function" and node.target in _PADS and len(node.users) == 1):
        return None
    pad = node.args[1] if len(node.args) > 1 else node.kwargs.get("pad")
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
    fill = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
    if mode != "constant" or fill not in (None, 0, 0.0) or not isinstance(pad, (tuple, list)) or len(pad) != 2 \
            or pad[0] != 0:
        return None
    width = _shape(node.args[0])[-1]
    for link in opath:
        if link.op == "call_function" and link.target is operator.getitem:
            index = link.args[1] if isinstance(link.args[1], tuple) else (link.args[1],)
            last = index[-1]
            keeps_last = _shape(link.args[0])[-1] == _shape(value)[-1] and (Ellipsis in index
                                                                           or len(index) == len(_shape(link.args[0])))
            if keeps_last and isinstance(last, slice) and last.start in (None, 0) and last.stop == width \
                    and last.step in (None, 1):
                return Padded(source=node.args[0], links=list(reversed(chain)), chain=[*chain, node])
            return None
        if _shape(link)[-1] != _shape(value)[-1]:
            return None
    return None
