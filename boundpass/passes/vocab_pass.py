"""Vocab pass: find the vocabulary projection + cross-entropy in a Dynamo graph by what it computes, and rewrite
it to the Ring-DTP custom op, so no [N, V] logits tensor exists in forward or backward.

A region is `projection -> (casts / reshapes / token slicing) -> cross-entropy`:
- projection: `F.linear(h, W)` (nn.Linear), `h @ B` / `torch.matmul(h, B)` / `h.matmul(B)` with a 2-D B
  (`W.T`, `W.t()`, `W.transpose(0, 1)`, or a [H, V] weight), `einsum('...h,vh->...v', h, W)` (or `hv`);
  W may be shared with the embedding (tied): the op's weight gradient and the embedding's add up in autograd;
- between them: `float` / `to(dtype)` / `contiguous`, `view` / `reshape` / `flatten` that keep the vocab dim last,
  and indexing of the token dims (`logits[:, :-1]`, `logits[..., :-1, :]`, a boolean token mask); these are
  replayed on the hidden states before the op, so the rewrite stays exact;
- cross-entropy: `F.cross_entropy`, `F.nll_loss(F.log_softmax(logits, -1))`, or hand-written
  `logsumexp(logits, -1) - logits.gather(-1, labels[..., None])[..., 0]` reduced by `.sum()` / `.mean()`,
  optionally masked by `labels != ignore_index` (`* mask`, `torch.where`, `masked_fill`, `[mask]`) with the
  gathered labels made safe (`clamp(min=0)`, `masked_fill`, `torch.where`). A denominator after the sum
  (`/ mask.sum()`, torchtitan's global valid tokens) stays as written.

Matching happens on the Dynamo (pre-autograd) graph: there these are still single nodes with `nn_module_stack`
meta, and AOTAutograd derives the backward from the op's registered autograd. Regions that cannot be
rewritten exactly are skipped with a reason, never silently.
"""
from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from boundpass.passes.graph_edit import example_value as _val
from boundpass.passes.graph_edit import concrete_size, set_op_arg, sweep_dead_nodes
from boundpass.core import symbols as sym
from boundpass.bound.bounds import Knob
from boundpass.passes.protocol import Diagnosis
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime import ring_dtp
from boundpass.measure.step_peak import module_path

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_NLL_SIGNATURE = inspect.signature(F.nll_loss)
_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
_MATMUL_TARGETS = (operator.matmul, torch.matmul)
# methods / functions that only reshape or upcast the logits on their way to the loss
_CAST_METHODS = {"float", "double", "half", "bfloat16", "contiguous", "to"}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}
_PASS_THROUGH_FUNCS = {torch.flatten, torch.reshape, operator.getitem}
_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax)


@dataclass
class VocabRegion:
    """One projection -> cross-entropy region: where it is, and what happened to it."""
    module_path: str
    rewritten: bool
    reason: str = ""
    kind: str = "vocab"
    form: str = ""                 # what was matched, e.g. "matmul(h, W.T) -> [:, :-1] -> cross_entropy"
    tokens: object = None          # N (int or SymInt) of the rewritten op
    hidden: int = 0
    vocab: int = 0
    dtype: torch.dtype | None = None
    block: int = 0                 # strip width C chosen by the budget
    branch: str = ""               # Ring-DTP branch chosen for the launch configuration
    op_node: fx.Node | None = field(default=None, repr=False)
    dropped_logits: list = field(default_factory=list)  # outputs that returned the logits, None now (keep_logits)

    def describe(self) -> str:
        if not self.rewritten:
            return f"SKIPPED   vocab  {self.module_path}: {self.reason}"
        dropped = (f"; the logits it returned ({', '.join(self.dropped_logits)}) are None in training "
                   f"(vocab_keep_logits=True keeps them)") if self.dropped_logits else ""
        return (f"REWRITTEN vocab  {self.module_path}: {self.form or 'linear -> cross_entropy'} => boundpass::ring_dtp "
                f"(N={self.tokens}, H={self.hidden}, V={self.vocab}, {self.dtype}, branch={self.branch}, "
                f"C={self.block}){dropped}")


@dataclass
class VocabRewriteConfig:
    """What the rewritten op is told: ring group, strip width (0 = whole shard), branch."""
    group_name: str = ""
    ring_size: int = 1
    ring_rank: int = 0
    block: int = 0
    branch: str = "auto"
    drop_logits: bool = False  # logits returned beside the loss become None in the output (Config vocab.keep_logits)


# ------------------------------------------------------------------------------------------ node shapes
def _is_call(node, *, methods=(), funcs=()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in methods
    return node.op == "call_function" and any(node.target is f for f in funcs)


def _arg(node: fx.Node, index: int, name: str, default=None):
    """Argument `index` (counting the tensor a method is called on) or keyword `name`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_tensor(node) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _is_pass_through(node) -> bool:
    """Casts, reshapes and indexing of a tensor (which of them keep the vocab dim is `_chain_reason`'s check)."""
    if not isinstance(node, fx.Node) or not node.args or not _is_tensor(node.args[0]):
        return False
    if node.op == "call_method" and node.target in _CAST_METHODS | _RESHAPE_METHODS:
        if node.target == "to":  # only dtype casts, not device moves
            return (all(isinstance(a, torch.dtype) for a in node.args[1:])
                    and set(node.kwargs) <= {"dtype"} and (len(node.args) > 1 or "dtype" in node.kwargs))
        if node.target == "view":  # view(shape), not a reinterpretation view(dtype)
            return not any(isinstance(a, torch.dtype) for a in node.args[1:]) and not node.kwargs
        return True
    return node.op == "call_function" and node.target in _PASS_THROUGH_FUNCS


# ------------------------------------------------------------------------------------------ projection
@dataclass
class _Projection:
    node: fx.Node          # the logits [..., V]
    h: fx.Node             # hidden states [..., H]
    weight: fx.Node        # [V, H] as used, or the [H, V] tensor to transpose (transpose=True)
    transpose: bool
    form: str
    bias: bool = False


def _untransposed(node):
    """W when node is W.T / W.t() / W.transpose(0, 1) / W.permute(1, 0) of a 2-D W, else None."""
    if not isinstance(node, fx.Node):
        return None
    src = node.args[0] if node.args else None
    if not _is_tensor(src) or _val(src).dim() != 2:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1:] in (("T",), ("mT",)):
        return src
    if _is_call(node, methods=("t",), funcs=(torch.t,)) and len(node.args) == 1:
        return src
    if _is_call(node, methods=("transpose",), funcs=(torch.transpose,)):
        dims = tuple(d % 2 for d in node.args[1:3]) if len(node.args) == 3 else None
        return src if dims in ((0, 1), (1, 0)) else None
    if _is_call(node, methods=("permute",), funcs=(torch.permute,)):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return src if tuple(d % 2 for d in dims) == (1, 0) else None
    return None


def _projection(node) -> _Projection | None:
    """The vocab projection computing node (h @ W.T in one of its spellings), or None."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    if node.op == "call_function" and node.target in _LINEAR_TARGETS:
        h, w = _arg(node, 0, "input"), _arg(node, 1, "weight")
        bias = _arg(node, 2, "bias")
        if _is_tensor(h) and _is_tensor(w) and _val(w).dim() == 2:
            return _Projection(node, h, w, False, "linear", bias=bias is not None)
        return None
    if _is_call(node, methods=("matmul",), funcs=_MATMUL_TARGETS + (torch.mm,)) and len(node.args) == 2:
        h, b = node.args
        if not (_is_tensor(h) and _is_tensor(b) and _val(b).dim() == 2 and _val(h).dim() >= 1):
            return None
        w = _untransposed(b)
        if w is not None:
            return _Projection(node, h, w, False, "matmul(h, W.T)")
        return _Projection(node, h, b, True, "matmul(h, W)")
    if node.op == "call_function" and node.target is torch.functional.einsum:
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        eq = node.args[0] if node.args and isinstance(node.args[0], str) else None
        if eq is None or len(operands) != 2 or "->" not in eq:
            return None
        lhs, out = eq.replace(" ", "").split("->")
        terms = lhs.split(",")
        if len(terms) != 2:
            return None
        for (a, b), (h, w) in (((terms[0], terms[1]), operands), ((terms[1], terms[0]), operands[::-1])):
            if len(b) != 2 or "." in b or not a or not (_is_tensor(h) and _is_tensor(w)):
                continue
            hid = a[-1]
            if hid not in b or b[0] == b[1] or hid in a[:-1]:
                continue
            voc = b[1] if b[0] == hid else b[0]
            if voc in a or out != a[:-1] + voc:
                continue
            return _Projection(node, h, w, b[0] == hid, f"einsum('{eq}')")
    return None


def _bias_add(node) -> bool:
    """`projection + b`: a bias the op cannot fold."""
    if not _is_call(node, methods=("add", "add_"), funcs=(operator.add, torch.add)) or len(node.args) < 2:
        return False
    return any(_projection(_trace_back(a)[0]) is not None for a in node.args[:2] if isinstance(a, fx.Node))


def _trace_back(node):
    """(first non-pass-through node, chain of pass-through nodes from it to `node`)."""
    chain = []
    while _is_pass_through(node):
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _index_keeps_last_dim(idx, ndim: int) -> bool:
    """Whether `x[idx]` (x of rank ndim) indexes only token dims, leaving the last (vocab) dim whole."""
    items = list(idx) if isinstance(idx, tuple) else [idx]

    def width(item):
        if item is None or item is Ellipsis:
            return 0
        val = _val(item)
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
            return val.dim()
        return 1
    used = sum(width(i) for i in items)
    dim = 0
    for item in items:
        w = width(item)
        if item is Ellipsis:
            w = ndim - used
            dim += w
            continue
        full = isinstance(item, slice) and item == slice(None)
        if w and dim <= ndim - 1 < dim + w and not full:
            return False
        dim += w
    return True


def _chain_reason(chain: list, vocab: int) -> str:
    """Why the pass-through chain cannot be replayed on the hidden states ("" when it can)."""
    for node in chain:
        src, out = _val(node.args[0]), _val(node)
        if not isinstance(out, torch.Tensor):
            return f"{node.name} does not give a tensor"
        if _is_call(node, funcs=_LOG_SOFTMAX, methods=("log_softmax",)):
            continue
        if src.shape[-1] != vocab or out.dim() == 0 or out.shape[-1] != vocab:
            return (f"{node.name} ({node.target}) moves the vocab dim of the logits ({tuple(src.shape)} -> "
                    f"{tuple(out.shape)}); only token dims may be reshaped or indexed")
        if node.target is operator.getitem and not _index_keeps_last_dim(node.args[1], src.dim()):
            return f"{node.name} indexes the vocab dim of the logits"
        if node.target in ("flatten", torch.flatten):
            end = _arg(node, 2, "end_dim", -1)
            if not isinstance(end, int) or end % src.dim() == src.dim() - 1:
                return f"{node.name} flattens the vocab dim of the logits"
    return ""


def _replay(add, chain: list, h: fx.Node, hidden: int):
    """The hidden states shaped and indexed as the chain shapes and indexes the logits (casts dropped), and
    {chain node: the hidden states shaped as that node's logits}."""
    x, at = h, {}
    for node in chain:
        if node.target is operator.getitem:
            x = add(operator.getitem, x, node.args[1])
        elif node.target in ("flatten", torch.flatten):
            x = add(torch.flatten, x, *node.args[1:], **node.kwargs)
        elif node.target in ("view", "reshape", torch.reshape):
            shape = node.args[1:] if node.op == "call_method" else node.args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            x = add("reshape", x, *shape[:-1], hidden, kind="call_method")  # reshape: h may be non-contiguous
        at[node] = x
    return x, at


def _adder(graph: fx.Graph, fake_mode, *, module_stack_of: fx.Node, trace_of: fx.Node):
    """Like graph_edit.node_adder, with nodes nested in the arguments (an index tuple holding a SymInt)."""
    def add(target, *args, kind="call_function", **kwargs):
        node = graph.create_node(kind, target, args, kwargs)
        node.meta["nn_module_stack"] = dict(module_stack_of.meta.get("nn_module_stack", {}))
        node.meta["stack_trace"] = trace_of.meta.get("stack_trace")
        vals = fx.node.map_arg(args, _val)
        kw = fx.node.map_arg(kwargs, _val)
        with fake_mode:
            node.meta["example_value"] = (getattr(vals[0], target)(*vals[1:], **kw) if kind == "call_method"
                                          else target(*vals, **kw))
        return node
    return add


# ------------------------------------------------------------------------------------------ losses
@dataclass
class _Match:
    """A cross-entropy over logits found in the graph: what to replace and what the op must be told."""
    anchor: fx.Node                  # the node whose value the op's (reduced) loss replaces
    loss: str                        # "cross_entropy", "log_softmax + nll_loss", "logsumexp - gather"
    loss_input: fx.Node | None = None  # where the walk back to the projection starts
    labels: fx.Node | None = None    # class indices, shaped as the logits' token dims
    region: set = field(default_factory=set)   # loss-side nodes that read the [.., V] logits
    tail: list = field(default_factory=list)   # [.., V] nodes between loss_input and the loss (log_softmax ...)
    norm: fx.Node | None = None      # the tensor the softmax normalisation runs on (its dtype is checked)
    ignore_index: int = -100
    reduction: str = "sum"           # "sum", "mean" (over valid tokens), "mean_all" (over all tokens)
    reason: str = ""
    drop: set = field(default_factory=set)       # nodes that only return the logits (config.drop_logits)
    dropped: list = field(default_factory=list)  # graph outputs that returned the logits, now None
    dead: list = field(default_factory=list)   # runtime size asserts on a boolean selection the rewrite removes
    twin: list = field(default_factory=list)   # a second spelling of the logits chain (read by gather)
    negate: bool = False                       # the region reduces log-probabilities (-loss): replace by -op
    lse_uses: list = field(default_factory=list)  # (logsumexp node, logits node it reads): served by the op's lse
    insert_before: fx.Node | None = None       # where the op goes (before the anchor, or the first lse use)


_NE_EQ_METHODS, _NE_EQ_FUNCS = ("ne", "eq"), (operator.ne, torch.ne, operator.eq, torch.eq)
_NOT_METHODS, _NOT_FUNCS = ("logical_not", "bitwise_not", "__invert__"), (operator.invert, torch.logical_not,
                                                                          torch.bitwise_not)
_MASK_CASTS = _CAST_METHODS | {"bool", "long", "int", "type_as"}


def _strip_casts(node):
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _MASK_CASTS and node.args:
        node = node.args[0]
    return node


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _mask_of(node, valid: bool):
    """(labels, ignore_index) when node is `labels != ignore_index` (valid) / `labels == ignore_index`
    (not valid), up to casts and negation; else None."""
    node = _strip_casts(node)
    if _is_call(node, methods=_NE_EQ_METHODS, funcs=_NE_EQ_FUNCS) and len(node.args) == 2 and not node.kwargs:
        labels, ig = node.args
        if not _is_tensor(labels) or not _is_int(ig):
            return None
        is_ne = node.target in ("ne", operator.ne, torch.ne)
        return (labels, ig) if is_ne == valid else None
    if _is_call(node, methods=_NOT_METHODS, funcs=_NOT_FUNCS) and len(node.args) == 1:
        return _mask_of(node.args[0], not valid)
    return None


def _view_root(node):
    while _is_call(node, methods=("view", "reshape", "flatten", "contiguous"), funcs=(torch.flatten, torch.reshape)):
        node = node.args[0]
    return node


def _same_tensor(a, b) -> bool:
    """a and b hold the same elements in the same layout (one node, or reshapes of one tensor to one shape)."""
    if a is b:
        return True
    return (_is_tensor(a) and _is_tensor(b) and _view_root(a) is _view_root(b)
            and tuple(_val(a).shape) == tuple(_val(b).shape))


def _ce_like_reason(args: dict, fn: str) -> str:
    if args.get("weight") is not None:
        return "class weights are used"
    if args.get("label_smoothing", 0.0) not in (0, 0.0):
        return "label smoothing is used"
    if args.get("size_average") is not None or args.get("reduce") is not None:
        return "legacy size_average/reduce arguments are used"
    if args.get("reduction", "mean") not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} returns per-token losses"
    logits, target = _val(args["input"]), _val(args["target"])
    if logits is None or target is None or logits.dim() != 2 or target.dim() != 1:
        return f"{fn} input is not [N, V] logits with [N] class-index targets"
    if not _is_int(args.get("ignore_index", -100)):
        return f"{fn} ignore_index is not a Python int"
    return ""


def _match_ce(node) -> _Match | None:
    if node.op != "call_function" or node.target is not F.cross_entropy:
        return None
    try:
        args = _CE_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    except TypeError as exc:
        return _Match(node, "cross_entropy", reason=f"cannot read cross_entropy arguments: {exc}")
    return _Match(node, "cross_entropy", loss_input=args["input"], labels=args["target"], region={node},
                  norm=args["input"], ignore_index=args.get("ignore_index", -100),
                  reduction=args.get("reduction", "mean"), reason=_ce_like_reason(args, "cross_entropy"))


def _is_log_softmax(node) -> bool:
    if not _is_call(node, methods=("log_softmax",), funcs=_LOG_SOFTMAX) or not _is_tensor(node.args[0]):
        return False
    return _last_dim(_arg(node, 1, "dim"), _val(node.args[0]).dim())


def _match_nll(node) -> _Match | None:
    if node.op != "call_function" or node.target is not F.nll_loss:
        return None
    try:
        args = _NLL_SIGNATURE.bind(*node.args, **node.kwargs).arguments
    except TypeError as exc:
        return _Match(node, "log_softmax + nll_loss", reason=f"cannot read nll_loss arguments: {exc}")
    match = _Match(node, "log_softmax + nll_loss", labels=args["target"], region={node},
                   ignore_index=args.get("ignore_index", -100), reduction=args.get("reduction", "mean"),
                   reason=_ce_like_reason(args, "nll_loss"))
    log_softmax, after = _trace_back(args["input"])
    if not _is_log_softmax(log_softmax):
        match.reason = match.reason or (f"nll_loss input is not log_softmax(logits, dim=-1) (found "
                                        f"{getattr(log_softmax, 'target', log_softmax)})")
        return match
    match.loss_input, match.tail, match.norm = log_softmax.args[0], [log_softmax] + after, log_softmax
    if not match.reason and _val(args["input"]).dtype != _val(log_softmax).dtype:
        match.reason = (f"the log-probabilities are cast from {_val(log_softmax).dtype} to "
                        f"{_val(args['input']).dtype} before nll_loss, which Ring-DTP would not reproduce")
    return match


def _logsumexp_input(node):
    if not _is_call(node, methods=("logsumexp",), funcs=(torch.logsumexp,)) or not _is_tensor(node.args[0]):
        return None
    if _arg(node, 2, "keepdim", False) or not _last_dim(_arg(node, 1, "dim"), _val(node.args[0]).dim()):
        return None
    return node.args[0]


def _unsqueezed(idx):
    """y when idx is y with a trailing unit dim (`y.unsqueeze(-1)`, `y[..., None]`, `y.view(*y.shape, 1)`)."""
    if not isinstance(idx, fx.Node) or not idx.args or not _is_tensor(idx.args[0]) or not _is_tensor(idx):
        return None
    y = idx.args[0]
    if tuple(_val(idx).shape) != tuple(_val(y).shape) + (1,):
        return None
    if _is_call(idx, methods=("unsqueeze",), funcs=(torch.unsqueeze,)):
        return y if _arg(idx, 1, "dim") in (-1, _val(y).dim()) else None
    if idx.target is operator.getitem:
        items = idx.args[1] if isinstance(idx.args[1], tuple) else (idx.args[1],)
        head = items[:-1]
        if items[-1] is None and all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in head):
            return y
        return None
    if _is_call(idx, methods=("view", "reshape"), funcs=(torch.reshape,)):
        return y
    return None


def _gathered(node):
    """(logits, gathered labels, [gather, squeeze]) when node is logits.gather(-1, y[..., None]).squeeze(-1)."""
    if not isinstance(node, fx.Node) or not node.args or not _is_tensor(node):
        return None
    squeeze, gather = node, node.args[0]
    if not (_is_call(squeeze, methods=("squeeze", "view", "reshape"), funcs=(torch.squeeze, torch.reshape))
            or squeeze.target is operator.getitem) or not _is_tensor(gather):
        return None
    if _is_call(gather, methods=("gather",), funcs=(torch.gather,)):
        logits, dim, idx = _arg(gather, 0, "input"), _arg(gather, 1, "dim"), _arg(gather, 2, "index")
    elif _is_call(gather, methods=("take_along_dim",), funcs=(torch.take_along_dim,)):
        logits, idx, dim = _arg(gather, 0, "input"), _arg(gather, 1, "indices"), _arg(gather, 2, "dim")
    else:
        return None
    if not _is_tensor(logits) or not _last_dim(dim, _val(logits).dim()):
        return None
    y = _unsqueezed(idx)
    lead = tuple(_val(logits).shape[:-1])
    if y is None or tuple(_val(y).shape) != lead or tuple(_val(squeeze).shape) != lead:
        return None
    return logits, y, [gather, squeeze]


def _safe_labels(y):
    """(labels, ignore_index or None, how) when y is labels made safe for gather at ignored tokens."""
    args = y.args
    if _is_call(y, methods=("clamp", "clamp_min"), funcs=(torch.clamp, torch.clamp_min)):
        lo, hi = _arg(y, 1, "min"), (_arg(y, 2, "max") if y.target in ("clamp", torch.clamp) else None)
        if _is_int(lo) and lo == 0 and hi is None:
            return args[0], None, "clamp"
    if _is_call(y, methods=("masked_fill",), funcs=(torch.masked_fill,)) and len(args) == 3 and args[2] is not True \
            and args[2] == 0:
        mask = _mask_of(args[1], valid=False)
        if mask and _same_tensor(mask[0], args[0]):
            return args[0], mask[1], "masked_fill"
    if _is_call(y, funcs=(torch.where,)) and len(args) == 3 and _is_int(args[2]) and args[2] == 0:
        mask = _mask_of(args[0], valid=True)
        if mask and _same_tensor(mask[0], args[1]):
            return args[1], mask[1], "where"
    return y, None, ""


def _full_reduction(node, per) -> str:
    """"sum" / "mean" when node reduces `per` over all its elements, else ""."""
    if node.op == "call_method" and node.target in ("sum", "mean") and node.args == (per,) and not node.kwargs:
        return node.target
    if node.op == "call_function" and node.target in (torch.sum, torch.mean) and node.args == (per,) \
            and not node.kwargs:
        return "sum" if node.target is torch.sum else "mean"
    return ""


_SIZE_CHECKS = (operator.ge, operator.le, operator.gt, operator.lt, operator.eq, operator.ne)


def _size_asserts(node):
    """The nodes that only assert the size of node's value (Dynamo adds them after a boolean selection, whose
    size is data-dependent), or None when its size is used for anything else."""
    found, todo = [], [u for u in node.users if u.op == "call_function" and u.target is torch.ops.aten.sym_size.int]
    while todo:
        n = todo.pop()
        found.append(n)
        for u in n.users:
            if u.op != "call_function" or not (u.target in _SIZE_CHECKS
                                               or u.target is torch.ops.aten._assert_scalar.default):
                return None
            if u not in found and u not in todo:
                todo.append(u)
    return found


_LSE_FORM = ("sum / mean of (logsumexp - gather), optionally masked by labels != ignore_index "
             "(* mask, torch.where, masked_fill, [mask])")


def _twin_chain(a, b):
    """The nodes of a's pass-through chain that repeat b's (same ops, same arguments, from one tensor), or None
    when a and b are not the same computation. `lg.float()` written twice is two nodes holding one value."""
    twin = []
    while a is not b:
        if not (_is_pass_through(a) and _is_pass_through(b) and a.op == b.op and a.target == b.target
                and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs):
            return None
        twin.append(a)
        a, b = a.args[0], b.args[0]
    return twin


def _match_lse(node) -> _Match | None:
    """Hand-written CE: `logsumexp(L, -1) - L.gather(-1, y[..., None])[..., 0]`, then sum / mean (masked)."""
    if not _is_call(node, methods=("sub",), funcs=(operator.sub, torch.sub)) or len(node.args) != 2 or node.kwargs:
        return None
    lse, tgt = node.args
    negate = _logsumexp_input(lse) is None   # `gather - logsumexp`: log-probabilities, reduced then negated
    if negate:
        lse, tgt = tgt, lse
    logits = _logsumexp_input(lse)
    gathered = _gathered(tgt)
    twin = _twin_chain(gathered[0], logits) if logits is not None and gathered is not None else None
    if twin is None:
        return None
    _, y, (gather, squeeze) = gathered
    # logsumexp and gather read one logits tensor (or the same casts / reshapes of it, spelled twice)
    match = _Match(node, "logsumexp - gather", loss_input=logits, region={lse, gather, *twin}, norm=logits,
                   twin=twin, negate=negate)
    if set(lse.users) - {node}:  # a z-loss on the same log-sum-exp: the op returns it (differentiable)
        match.lse_uses.append((lse, logits))
    per_token = {gather: {squeeze}, squeeze: {node}}
    for n, allowed in per_token.items():
        if set(n.users) - allowed:
            match.reason = (f"{n.name} of the hand-written cross-entropy is used elsewhere too "
                            f"({sorted(u.name for u in set(n.users) - allowed)})")
            return match
    return _reduce(match, node, y)


def _reduce(match: _Match, per: fx.Node, y: fx.Node) -> _Match:
    """Complete match from the reduction of the per-token losses `per` over the gathered labels `y`:
    `.sum()` / `.mean()`, or masked by labels != ignore_index, then `.sum()` / `.mean()`."""
    labels, safe_ig, safe = _safe_labels(y)
    users = list(per.users)
    if len(users) != 1:
        match.reason = (f"the per-token losses ({per.name}) are used elsewhere too "
                        f"({sorted(u.name for u in users)}): the rewritten op returns only their sum")
        return match
    r, mask, selected = users[0], None, False
    how = _full_reduction(r, per)
    if how:
        match.anchor, match.reduction = r, ("sum" if how == "sum" else "mean_all")
        if safe:
            match.reason = (f"the labels are made safe for gather ({safe}) but the per-token losses are not "
                            f"masked: ignored tokens count in the loss")
        match.labels = labels
        return match
    args = r.args
    if _is_call(r, methods=("mul",), funcs=(operator.mul, torch.mul)) and len(args) == 2 and not r.kwargs:
        mask = _mask_of(args[1] if args[0] is per else args[0], valid=True)
    elif _is_call(r, funcs=(torch.where,)) and len(args) == 3 and args[1] is per and args[2] in (0, 0.0) \
            and not isinstance(args[2], bool):
        mask = _mask_of(args[0], valid=True)
    elif _is_call(r, methods=("masked_fill",), funcs=(torch.masked_fill,)) and len(args) == 3 and args[0] is per \
            and args[2] in (0, 0.0) and not isinstance(args[2], bool):
        mask = _mask_of(args[1], valid=False)
    elif r.target is operator.getitem and args[0] is per and isinstance(_val(args[1]), torch.Tensor) \
            and _val(args[1]).dtype == torch.bool:
        mask, selected = _mask_of(args[1], valid=True), True
    asserts = _size_asserts(r) or []
    reduced = [u for u in r.users if u not in asserts]
    how = _full_reduction(reduced[0], r) if len(reduced) == 1 else ""
    if mask is None or not how:
        match.reason = (f"hand-written cross-entropy: its per-token losses ({per.name}) go to {r.name} "
                        f"({r.target}), not a recognised reduction ({_LSE_FORM})")
        return match
    if not _same_tensor(mask[0], labels) or (safe_ig is not None and safe_ig != mask[1]):
        match.reason = (f"hand-written cross-entropy: the mask ({mask[0].name} != {mask[1]}) is not over the "
                        f"gathered labels ({labels.name})")
        return match
    match.anchor, match.labels, match.ignore_index, match.dead = reduced[0], labels, mask[1], asserts
    match.reduction = "sum" if how == "sum" else ("mean" if selected else "mean_all")
    return match


_NEG_METHODS, _NEG_FUNCS = ("neg", "__neg__"), (operator.neg, torch.neg)


def _match_logp_gather(node) -> _Match | None:
    """Hand-written NLL: `-log_softmax(L, -1).gather(-1, y[..., None])[..., 0]` (the minus anywhere after the
    gather: on the per-token values, or on their sum), then sum / mean (masked) as in `_reduce`."""
    gathered = _gathered(node)
    if gathered is None:
        return None
    logp, y, (gather, squeeze) = gathered
    log_softmax, after = _trace_back(logp)
    if not _is_log_softmax(log_softmax):
        return None
    match = _Match(node, "-log_softmax.gather", loss_input=log_softmax.args[0], region={gather},
                   tail=[log_softmax] + after, norm=log_softmax)
    if _val(logp).dtype != _val(log_softmax).dtype:
        match.reason = (f"the log-probabilities are cast from {_val(log_softmax).dtype} to {_val(logp).dtype} "
                        f"before the gather, which Ring-DTP would not reproduce")
        return match
    if set(gather.users) != {squeeze}:
        match.reason = f"{gather.name} of the hand-written cross-entropy is used elsewhere too"
        return match
    users = list(squeeze.users)
    if len(users) == 1 and _is_call(users[0], methods=_NEG_METHODS, funcs=_NEG_FUNCS):
        return _reduce(match, users[0], y)   # per-token losses -log p
    match.negate = True                      # reduce the log-probabilities; the op's loss goes in negated
    return _reduce(match, squeeze, y)


# ------------------------------------------------------------------------------------------ the pass
def _reaches_output(node, depth: int = 8) -> bool:
    """Whether node's value (or an alias / cast / reshape of it) is an output of the graph."""
    if node.op == "output":
        return True
    aliasing = _is_pass_through(node) or _is_call(node, methods=("detach", "clone", "cpu"), funcs=(torch.detach,))
    return depth > 0 and aliasing and any(_reaches_output(u, depth - 1) for u in node.users)


def _output_only(node, depth: int = 8) -> set | None:
    """``node`` and the aliases / casts / reshapes of it that lead only to the graph's output (None if anything else
    reads one of them)."""
    if depth < 0:
        return None
    aliasing = _is_pass_through(node) or _is_call(node, methods=("detach", "clone", "cpu") + tuple(_CAST_METHODS),
                                                   funcs=(torch.detach,))
    if not aliasing:
        return None
    out = {node}
    for user in node.users:
        if user.op == "output":
            continue
        more = _output_only(user, depth - 1)
        if more is None:
            return None
        out |= more
    return out


def _returned_logits(nodes: list, allowed: set) -> set | None:
    """The nodes that only return the logits (``nodes``' readers outside the region that lead to the graph's output
    and nowhere else); None when something else reads them (then they must exist)."""
    drop = set()
    for node in nodes:
        for user in node.users:
            if user in allowed or user.op == "output":
                continue
            only = _output_only(user)
            if only is None:
                return None
            drop |= only
    return drop


def _drop_returned_logits(match: _Match, nodes: list) -> None:
    """The logits' output slots become None (the caller gets ``logits=None``, as Liger-Kernel's patched Hugging Face
    models return in training) and the nodes that only fed the output go, so the [N, V] tensor need not exist."""
    graph = match.anchor.graph
    out_node = graph.find_nodes(op="output")[0]
    drop = match.drop | {n for n in nodes if out_node in n.users}
    if not drop:
        return

    def replace(value):
        if isinstance(value, fx.Node) and value in drop:
            match.dropped.append(value.name)
            return None
        if isinstance(value, (tuple, list)):
            return type(value)(replace(v) for v in value)
        if isinstance(value, dict):
            return {k: replace(v) for k, v in value.items()}
        return value
    out_node.args = tuple(replace(a) for a in out_node.args)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(match.drop, key=lambda n: -order[n]):
        if not node.users:
            graph.erase_node(node)


def _users_reason(nodes: list, allowed: set, path: str) -> str:
    for node in nodes:
        extra = [u for u in node.users if u not in allowed]
        if not extra:
            continue
        shape = tuple(_val(node).shape)
        if any(_reaches_output(u) for u in extra):
            return (f"the logits of {path} ({node.name}: {shape}) are also returned by the compiled graph, so the "
                    f"[N, V] tensor must exist: return only the loss from the model and loss_fn (e.g. `return loss`, "
                    f"not `return loss, logits`; compute logits for evaluation outside the bounded step)")
        return (f"the logits of {path} ({node.name}: {shape}) are used elsewhere too "
                f"({sorted(u.name for u in extra)}): the [N, V] tensor must exist; use them only in the loss")
    return ""


def _fmt(node) -> str:
    if node.target is operator.getitem:
        items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)

        def one(i):
            if i is Ellipsis:
                return "..."
            if isinstance(i, slice):
                return ":".join("" if p is None else str(p) for p in (i.start, i.stop)) + \
                    ("" if i.step is None else f":{i.step}")
            return str(getattr(i, "name", i))
        return "[" + ", ".join(one(i) for i in items) + "]"
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def _resolve(match: _Match, config: "VocabRewriteConfig | None" = None):
    """(projection, chain of [.., V] nodes from it to the loss, module path, reason)."""
    config = config or VocabRewriteConfig()
    ring_size = config.ring_size
    proj, chain, reason = None, [], match.reason
    if match.loss_input is not None:
        base, chain = _trace_back(match.loss_input)
        chain = chain + match.tail
        proj = _projection(base)
        if proj is None and not reason:
            reason = ("the output projection has a bias (not supported by Ring-DTP)" if _bias_add(base) else
                      f"{match.loss} input does not come from a vocab projection (linear, matmul with a 2-D weight "
                      f"or einsum '...h,vh->...v'; found {getattr(base, 'target', base)})")
    path = module_path(proj.node if proj is not None else match.anchor) or "<top level>"  # the projection's module, if found
    if reason:
        return proj, chain, path, reason
    w = _val(proj.weight)
    vocab = int(w.shape[1] if proj.transpose else w.shape[0])
    if proj.bias:
        return proj, chain, path, "the output projection has a bias (not supported by Ring-DTP)"
    h_dtype, norm_dtype = _val(proj.h).dtype, _val(match.norm).dtype
    acc = torch.promote_types(h_dtype, torch.float32)
    allowed = set(chain) | match.region | _z_loss_uses(match, proj, chain, acc)
    reason = _chain_reason(chain, vocab)
    if not reason and config.drop_logits:  # dropped only if the region is rewritten (rewrite_vocab_regions)
        drop = _returned_logits([proj.node] + chain + match.twin, allowed)
        if drop is not None:
            match.drop = drop
            allowed |= drop | set(proj.node.graph.find_nodes(op="output"))
    reason = reason or _users_reason([proj.node] + chain + match.twin, allowed, path)
    if not reason:
        if norm_dtype != acc:
            reason = (f"{match.loss} runs on {norm_dtype} logits of a {h_dtype} projection; "
                      f"Ring-DTP accumulates in {acc}, which would change the numerics")
        for node in chain:  # a round trip through a narrower dtype (fp32 -> bf16 -> fp32) rounds the logits
            src, out = _val(node.args[0]).dtype, _val(node).dtype
            if not reason and torch.promote_types(src, out) != out:
                reason = (f"{node.name} casts the logits from {src} to {out} before {match.loss}; Ring-DTP "
                          f"accumulates in {acc}, which would change the numerics")
    gathered = None if proj.transpose else _gathered_shard(proj.weight, config)
    if not reason and ring_size > 1 and not _is_parameter(proj.weight) and gathered is None:
        reason = (f"the projection weight ({proj.weight.name}) is not a parameter: over a ring of {ring_size} "
                  f"ranks the op returns each rank's rows of its gradient, which only a data-parallel gradient "
                  f"sum of parameters completes (or the ring's all-gather of a vocab-sharded weight)")
    if not reason:  # last: it may move the labels' reshape up the graph
        reason = _place(match, proj, chain)
    return proj, chain, path, reason


def _z_loss_uses(match: _Match, proj: _Projection, chain: list, acc) -> set:
    """`logsumexp(c, -1)` of the logits c (a z-loss) where the op's per-token lse is that value: c holds the op's
    tokens in its leading dims (only reshapes and casts follow it) in the op's accumulation dtype. Recorded in
    match.lse_uses; returns those nodes."""
    found = set()
    for i, c in enumerate([proj.node] + chain):
        after = chain[i:]
        if any(n.target is operator.getitem or n in match.tail for n in after) or _val(c).dtype != acc:
            continue
        for u in c.users:
            if u not in match.region and _logsumexp_input(u) is c:
                match.lse_uses.append((u, c))
                found.add(u)
    return found


def _place(match: _Match, proj: _Projection, chain: list) -> str:
    """Set where the op goes: before the loss, or before the first use of a log-sum-exp it serves (a z-loss
    computed before the cross-entropy). The op's inputs must exist there: pure nodes computing them (the labels'
    reshape) are moved up; anything else is a reason not to rewrite."""
    match.insert_before = match.anchor
    if not match.lse_uses:
        return ""
    order = {n: i for i, n in enumerate(match.anchor.graph.nodes)}
    first = min([match.anchor] + [v for u, _ in match.lse_uses for v in u.users], key=order.get)
    placed = {n for n in order if order[n] < order[first]}
    needed = [proj.h, proj.weight, match.labels]
    for node in chain:
        fx.node.map_arg((node.args[1:], node.kwargs), needed.append)
    late = sorted({n for n in needed if n not in placed}, key=order.get)
    movable, seen, todo = [], set(), list(late)
    while todo:  # the late nodes and what they read that is late too
        n = todo.pop()
        if n in seen or n in placed:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or n.is_impure() or \
                n in {u for u, _ in match.lse_uses} or n is proj.node or n in chain:
            return (f"the log-sum-exp of the logits ({match.lse_uses[0][0].name}) is used (at {first.name}) "
                    f"before the loss's input {n.name} exists: compute the cross-entropy first")
        movable.append(n)
        fx.node.map_arg((n.args, n.kwargs), todo.append)
    for n in sorted(movable, key=order.get):
        first.prepend(n)
    match.insert_before = first
    return ""


GATHERS = tuple(t for ns in ("_c10d_functional", "_c10d_functional_autograd")
                 for t in (getattr(getattr(torch.ops, ns), "all_gather_into_tensor", None),) if t is not None)
GATHERS = GATHERS + tuple(t.default for t in GATHERS)


def _gathered_shard(node, config: "VocabRewriteConfig"):
    """(this rank's shard, the wait node, the gather node) when ``node`` is the ring's all-gather of the shards along
    the vocab rows (``wait_tensor(all_gather_into_tensor(shard, P, ring))``: a vocab-sharded head gathered for the
    standard schedule, e.g. the MoP layout's), else None. Ring-DTP then runs on the shard itself: no rank gathers the
    weight, and the shard's gradient (every rank's tokens for its rows) is what the gather's backward, a sum
    reduce-scatter, gives it."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in (torch.ops._c10d_functional.wait_tensor, torch.ops._c10d_functional.wait_tensor.default)):
        return None
    gather = node.args[0]
    if not (isinstance(gather, fx.Node) and gather.op == "call_function" and gather.target in GATHERS):
        return None
    shard, size, group = (list(gather.args) + [None, None, None])[:3]
    if config.ring_size <= 1 or size != config.ring_size or group != config.group_name or not _is_tensor(shard):
        return None
    if _val(shard).dim() != 2 or _val(shard).shape[0] * size != _val(node).shape[0]:
        return None
    return shard, node, gather


def _is_parameter(node) -> bool:
    """A parameter of the model (a graph input or attribute holding an nn.Parameter), or its transpose."""
    node = _untransposed(node) or node
    return (isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")
            and isinstance(_val(node), torch.nn.Parameter))


def rewrite_vocab_regions(gm: fx.GraphModule, config: VocabRewriteConfig) -> list[VocabRegion]:
    """Rewrite every eligible region in place; return all regions found (rewritten and skipped)."""
    regions, erased, gathers = [], set(), []
    for node in list(gm.graph.nodes):
        if node in erased or node.op not in ("call_function", "call_method"):
            continue
        match = _match_ce(node) or _match_nll(node) or _match_lse(node) or _match_logp_gather(node)
        if match is None:
            continue
        proj, chain, path, reason = _resolve(match, config)
        form = " -> ".join([proj.form] + [_fmt(n) for n in chain if n not in match.tail] + [match.loss]) \
            if proj is not None else match.loss
        if match.lse_uses and not reason:
            form += " (+ its logsumexp, e.g. a z-loss)"
        if reason:
            regions.append(VocabRegion(module_path=path, rewritten=False, reason=reason, form=form))
            continue
        gathered = None if proj.transpose else _gathered_shard(proj.weight, config)
        if config.drop_logits:
            _drop_returned_logits(match, [proj.node] + chain + match.twin)
        regions.append(_rewrite(gm, match, proj, chain, config, path, form, gathered))
        regions[-1].dropped_logits = list(match.dropped)
        erased.update([match.anchor, *match.dead])
        if gathered is not None:
            gathers.append(gathered[1:])
    # drop what the rewrite left unused (the projection, its casts), never a mutation whose result nobody reads: a
    # Dynamo graph keeps in-place methods (out.index_add_(...) in a hand-written MoE) as nodes without users, and
    # FX's default purity test does not know them; only this graph (sweep_dead_nodes: FX's own sweep would also
    # enter checkpoint bodies with its default test)
    sweep_dead_nodes(gm.graph, _keeps_side_effects)
    for wait, gather in gathers:  # the all-gather of a sharded weight, now unread (a collective: FX keeps it)
        if not wait.users:
            gm.graph.erase_node(wait)
        if not gather.users:
            gm.graph.erase_node(gather)
    gm.graph.lint()
    gm.recompile()
    return regions


def _keeps_side_effects(node: fx.Node) -> bool:
    """FX's impure test, plus in-place methods / functions and mutating op overloads (they act on their inputs)."""
    if node.is_impure():
        return True
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return schema.is_mutable
        return getattr(node.target, "__name__", "").endswith("_")
    return False


def _rewrite(gm, match: _Match, proj: _Projection, chain, config, path, form, gathered=None) -> VocabRegion:
    """gathered: ``_gathered_shard`` of the projection's weight (the shard the op then runs on), or None."""
    w_val, h_val = _val(proj.weight), _val(proj.h)
    vocab, hidden = (int(w_val.shape[1]), int(w_val.shape[0])) if proj.transpose else \
        (int(w_val.shape[0]), int(w_val.shape[1]))
    anchor = match.anchor
    fake_mode = _val(anchor).fake_mode  # the graph's own fake mode (the backend's differs: docs/design.md §3)
    ignore_index = int(match.ignore_index)
    graph = gm.graph
    add = _adder(graph, fake_mode, module_stack_of=proj.node, trace_of=anchor)

    with graph.inserting_before(match.insert_before or anchor):
        x, at = _replay(add, chain, proj.h, hidden)  # the logits' token slicing / reshapes, applied to h
        tokens = add("reshape", x, -1, hidden, kind="call_method")
        labels = add("reshape", match.labels, -1, kind="call_method")
        weight = add("t", proj.weight, kind="call_method") if proj.transpose else proj.weight
        shard = weight
        if gathered is not None:
            shard = gathered[0]  # a vocab-sharded weight: this rank's rows are its shard (nothing gathered)
        elif config.ring_size > 1:
            # replicated weight: this rank folds only its own rows; the gradient of the other rows comes
            # from their owners, so summing gradients over the ring (data-parallel all-reduce) is exact.
            start, stop = ring_dtp.vocab_shard_range(vocab, config.ring_size, config.ring_rank)
            shard = add(operator.getitem, weight, slice(start, stop))
        fused = add(torch.ops.boundpass.ring_dtp_fwd.default, tokens, shard, labels, vocab, config.group_name,
                    config.block, ignore_index, config.branch, [])
        loss = add(operator.getitem, fused, 0)
        if match.reduction == "mean":
            valid = add(operator.ne, labels, ignore_index)
            count = add("sum", valid, kind="call_method")
            loss = add(operator.truediv, loss, count)
        elif match.reduction == "mean_all":
            loss = add(operator.truediv, loss, add("numel", labels, kind="call_method"))
        if match.negate:
            loss = add(operator.neg, loss)
        if match.lse_uses:
            lse = add(operator.getitem, fused, 1)
            for use, logits in match.lse_uses:  # the op's per-token lse, shaped as logits' token dims
                like = add("select", at.get(logits, proj.h), -1, 0, kind="call_method")
                use.replace_all_uses_with(add("view_as", lse, like, kind="call_method"))
    anchor.replace_all_uses_with(loss)
    graph.erase_node(anchor)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(match.dead, key=order.__getitem__, reverse=True):  # asserts on a selection now gone
        graph.erase_node(node)
    return VocabRegion(module_path=path, rewritten=True, form=form, tokens=_val(tokens).shape[0], hidden=hidden,
                       vocab=vocab, dtype=h_val.dtype, op_node=fused)


# ------------------------------------------------------------------------------- step-peak workspace


# ------------------------------------------------------------------------------------------------ the pass
MIN_VOCAB_BLOCK = 128  # narrower strips only add per-strip overhead; below this, change P or N instead


class VocabPass:
    """projection -> cross-entropy => Ring-DTP (boundpass.passes.pipeline's protocol); its knob: the strip width C."""
    name = "vocab"

    def enabled(self, config) -> bool:
        return config.vocab.enable

    def rewrite(self, gm: fx.GraphModule, ctx) -> list[VocabRegion]:
        return rewrite_vocab_regions(gm, VocabRewriteConfig(
            group_name=ctx.group_name, ring_size=ctx.ring_size, ring_rank=ctx.ring_rank, drop_logits=ctx.drop_logits,
            block=ctx.fixed.get("vocab_block", 0)))

    def knobs(self, regions: list, ctx) -> list[Knob]:
        """Set each op's branch from N_max (a launch fact) and open its strip width C for the planner."""
        from boundpass.bound import cost_model
        from boundpass.runtime.agreement import global_max_tokens
        rewritten = [r for r in regions if r.rewritten]
        if not rewritten:
            return []
        hi, shapes = 0, []
        for region in rewritten:
            tokens_here = concrete_size(region.tokens, region.op_node)
            # the branch must agree over the ring: chosen from the ring's largest N (one all-reduce), not this rank's;
            # every rank compiles at the same call (forward), so the all-reduce runs even with max_tokens_per_rank and
            # a rank over it makes every rank raise the same error (a lone raise would leave its peers waiting)
            ring_max = global_max_tokens(tokens_here, ctx.ring_group)
            max_tokens = ctx.max_tokens_per_rank or ring_max
            if ctx.ring_size > 1:
                ctx.ring_n_max = max(ctx.ring_n_max, max_tokens)
            if max_tokens < ring_max:
                raise BoundpassInputError(f"max_tokens_per_rank={max_tokens} but a rank of the ring holds {ring_max} "
                                          f"tokens at the vocab projection ({region.module_path}; this rank "
                                          f"{tokens_here}): raise max_tokens_per_rank on every rank")
            region.branch = ring_dtp.choose_branch(max_tokens, region.vocab, ctx.ring_size)
            set_op_arg(region.op_node, "branch", region.branch)
            hi = max(hi, -(-region.vocab // ctx.ring_size))
            shapes.append((tokens_here if region.branch == "weights" else max_tokens, region))
        lo = min(MIN_VOCAB_BLOCK, hi)

        def knee_of(tokens: int, region) -> int:  # the planner goes no wider than the knee of the op's time model
            val = region.op_node.args[0].meta.get("val") if region.op_node is not None and region.op_node.args else None
            b = (region.dtype or torch.float32).itemsize
            return cost_model.ring_dtp_knee(lo=lo, hi=hi, N=max(1, int(tokens)), H=region.hidden, V=region.vocab,
                                            P=ctx.ring_size, b=b, b_acc=max(b, 4),
                                            costs=cost_model.costs_for(getattr(getattr(val, "device", None), "type",
                                                                               "cpu")))
        return [Knob("vocab_block", sym.C, lo=lo, hi=hi, arg="block",
                     ops=(torch.ops.boundpass.ring_dtp_fwd.default, torch.ops.boundpass.ring_dtp_bwd.default),
                     user=ctx.config.vocab.block, regions=rewritten, knee=max(knee_of(n, r) for n, r in shapes),
                     owner=self.name)]

    def diagnose(self, knob: Knob, where: str):
        tokens = knob.regions[0].tokens if knob.regions else "?"
        return Diagnosis(fix="increase the ring size P (boundpass.compile(..., ring_group=<group of more ranks>)) "
                             f"or reduce tokens per rank N (now {tokens}); the narrowest strip C={knob.lo} does not fit",
                         detail=f"at C={knob.value}", name=f"vocab (Ring-DTP, C={knob.value}){where}")
