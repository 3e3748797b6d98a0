"""Pipeline stages of an adapted Hugging Face causal LM, from its config's `base_model_pp_plan`: the plan's modules
before `layers` (the embedding) on the first stage, a slice of the layers on each, the modules after `layers` (the
final norm) and the causal LM's head on the last (with what the model's forward does to the head's logits: its
scaling or softcapping, read from its source by moe_lst.models.hf.model.logit_transform, and to the hidden states
before the head, head_input_transform), all under the model's own names, for the runtime's pipeline
(zero.parallel.pipeline).

What the base model's forward does around its layers is read from its source (`ast`) and repeated: the statements
between the embedding and the layers (embedding multipliers, dropouts: _EMBEDDING_FORMS) on the first stage; the
layer arguments it makes from the positions alone, by replaying its own statements (LayerReplay); a fresh dict for
layers that share keys and values (a reuse layer and its source on one stage); Gemma's per-layer inputs, made on the
first stage and sent on after the hidden states. Anything else is refused in one line naming it."""

from __future__ import annotations

import ast
import builtins
import inspect
import math
import textwrap
from collections.abc import Callable

import torch
import torch.nn.functional as F
from moe_lst.kernels.documents import Documents
from moe_lst.models.hf import attention as hf_attn
from torch import nn

from zero.contract import ContractError, ModelContract
from zero.dist import comm
from zero.plan import AttachedLossScale, attach_loss

#: The usual name of the plan's repeated layers (GPT-J's plan names them `h`: the stage takes the list it names).
LAYERS = "layers"
#: Modules of the base model outside its pp plan that a stage may share: they hold buffers only (rotary tables).
ROTARY = "rotary_emb"


#: The keyword arguments a stage gives (or leaves at their defaults for) the layers it calls; `shared_kv_states` is a
#: fresh dict per stage call (see _kv_sharing_problem for the layers that read another layer's keys and values).
LAYER_ARGUMENTS = {"attention_mask", "position_ids", "cache", "past_key_values", "layer_past", "use_cache",
                   "cache_position", "position_embeddings", "shared_kv_states"}
#: Statements between a base model's embedding and its layers that change the hidden states, which the first stage
#: repeats (as transformers writes them, unparsed by `ast`), each with the transform of (base model, hidden states,
#: training): the input multipliers and dropouts transformers' families use.
_EMBEDDING_FORMS: dict[str, Callable[[nn.Module, torch.Tensor, bool], torch.Tensor]] = {
    "inputs_embeds = inputs_embeds * self.embedding_multiplier":
        lambda base, x, training: x * base.embedding_multiplier,
    "if self.config.mup_enabled:\n    hidden_states = hidden_states * self.config.hidden_size ** 0.5":
        lambda base, x, training: x * base.config.hidden_size ** 0.5 if base.config.mup_enabled else x,
    "inputs_embeds = self.embed_dropout(inputs_embeds)":
        lambda base, x, training: F.dropout(x, base.embed_dropout.p, training),
    "hidden_states = nn.functional.dropout(hidden_states, p=self.embedding_dropout, training=self.training)":
        lambda base, x, training: F.dropout(x, base.embedding_dropout, training),
    # (token type embeddings: the adapter gives no token_type_ids, so this adds nothing)
    "if token_type_ids is not None:\n    token_type_ids = token_type_ids.view(-1, seq_length)\n    hidden_states = "
    "hidden_states + self.wte(token_type_ids)": lambda base, x, training: x,
}
#: The names a base model's forward holds its hidden states under before and between its layers.
_HIDDEN = ("inputs_embeds", "hidden_states")


def _forward_tree(base_class: type) -> tuple[ast.FunctionDef, int] | None:
    """(`base_class.forward` parsed, the index in its body of the loop over its layers: the first `for` whose
    variable it calls, e.g. `decoder_layer(...)` or `block(...)`), or None where its source cannot be read or has no
    such loop."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(base_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    loop = next((k for k, s in enumerate(fn.body) if isinstance(s, ast.For) and _layer_call(s) is not None), None)
    return None if loop is None else (fn, loop)


def _loop_variable(loop: ast.For) -> str | None:
    """The name a layers' loop binds each layer to (`for decoder_layer in ...`, `for i, block in enumerate(...)`)."""
    target = loop.target
    if isinstance(target, ast.Tuple) and target.elts:
        target = target.elts[-1]
    return target.id if isinstance(target, ast.Name) else None


def _layer_call(node: ast.AST, name: str | None = None) -> ast.Call | None:
    """The first call of the layer under `node` (a layers' loop, or with `name` its variable, a statement of its
    body): `decoder_layer(...)`."""
    if name is None and isinstance(node, ast.For):
        name = _loop_variable(node)
    if name is None:
        return None
    return next((n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == name), None)


def layer_arguments(base_class: type) -> set[str]:
    """The keyword arguments `base_class`'s forward passes to its layers (`decoder_layer(...)`), read from its source
    (empty where it cannot be read); a second positional argument counts under its expression (e.g.
    `per_layer_input`)."""
    found = _forward_tree(base_class)
    if found is None:
        return set()
    call = _layer_call(found[0].body[found[1]])
    return {k.arg for k in call.keywords if k.arg} | {ast.unparse(a) for a in call.args[1:]}


def _assigns_hidden(statement: ast.stmt) -> bool:
    """Whether `statement` assigns the hidden states (inputs_embeds / hidden_states), anywhere inside it."""
    for node in ast.walk(statement):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        if any(isinstance(n, ast.Name) and n.id in _HIDDEN for t in targets for n in ast.walk(t)):
            return True
    return False


def _is_lookup(statement: ast.stmt, before: list[str]) -> bool:
    """Whether `statement` is the embedding's lookup (`inputs_embeds = self.embed_tokens(input_ids)`, under an `if`
    on the inputs or not) or names it the hidden states (`hidden_states = inputs_embeds`)."""
    if isinstance(statement, ast.If):
        return all(_is_lookup(s, before) for s in statement.body) and not statement.orelse
    if not isinstance(statement, (ast.Assign, ast.AnnAssign)) or statement.value is None:
        return False
    value = statement.value
    if isinstance(value, ast.Name):
        return value.id == "inputs_embeds"
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in before
            and isinstance(value.func.value, ast.Name) and value.func.value.id == "self")


def embedding_statements(base_class: type, before: list[str], after: list[str]) -> tuple[list, str | None]:
    """(the transforms of the hidden states the base model's forward runs between its embedding and its layers, in
    order, from _EMBEDDING_FORMS; what it runs on them that a stage does not repeat, or None): the statements
    assigning them before the layers' loop other than the lookup, and after it anything but the plan's final
    modules (`hidden_states = self.norm(hidden_states)`)."""
    found = _forward_tree(base_class)
    if found is None:
        return [], "its forward's source has no `for ... decoder_layer(...)` loop to read"
    fn, loop = found
    forms = []
    for statement in fn.body[:loop]:
        if not _assigns_hidden(statement) or _is_lookup(statement, before):
            continue
        text = ast.unparse(statement)
        if text not in _EMBEDDING_FORMS:
            return forms, f"its forward runs `{text.splitlines()[0]}` before its layers"
        forms.append(_EMBEDDING_FORMS[text])
    finals = [f"hidden_states = self.{name}(hidden_states)" for name in after]
    ran = [ast.unparse(s) for s in fn.body[loop + 1:] if _assigns_hidden(s)]
    if ran != finals:
        extra = next((t for t in ran if t not in finals), None) or "; ".join(ran) or "nothing"
        return forms, f"its forward runs `{extra.splitlines()[0]}` after its layers, not only its final modules"
    return forms, None


def _kv_sharing_problem(config, layers: range) -> str | None:
    """Where a layer of `layers` reads the keys and values another layer stored (config.kv_sharing_modes "reuse": the
    last "store" layer of its type before it) and that layer is on another stage: what, in one line."""
    modes = getattr(config, "kv_sharing_modes", None)
    if not modes or "reuse" not in modes:
        return None
    kinds = list(config.layer_types)
    for i in layers:
        if modes[i] != "reuse":
            continue
        source = next((j for j in range(i - 1, -1, -1) if modes[j] == "store" and kinds[j] == kinds[i]), None)
        if source is None or source not in layers:
            return (f"layer {i} reuses the keys and values of layer {source} (num_kv_shared_layers="
                    f"{config.num_kv_shared_layers}), which is on another stage: put them on one stage")
    return None


#: The layers' position_embeddings as the stage's own rotary tables give them: one table, or one per layer type.
_TABLE_FORMS = ("position_embeddings", "position_embeddings[self.config.layer_types[i]]")
#: What a replay of the base model's statements is given: the base model, the stage's hidden states (as the
#: embedding's output: the rotary embeddings read their dtype and device) and the position ids.
_REPLAY_INPUTS = ("self", "hidden_states", "inputs_embeds", "position_ids")


def _names(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(names `node` reads from outside it, names it assigns, containers it assigns items of); the variables of its
    loops and comprehensions are its own."""
    reads, binds, items, local = set(), set(), set(), set()
    for n in ast.walk(node):
        if isinstance(n, (ast.For, ast.comprehension)):
            local |= {m.id for m in ast.walk(n.target) if isinstance(m, ast.Name)}
        if isinstance(n, ast.Name):
            (reads if isinstance(n.ctx, ast.Load) else binds).add(n.id)
        elif isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, ast.Store):
            base = n.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                items.add(base.id)
    return reads - local, binds - local, items - local


class LayerReplay:
    """Keyword arguments of the layers that the base model's forward makes from the positions alone (a query scale
    of layers without rope, rotary tables chosen per layer from several rotary embeddings, or none for some layers),
    made by its own statements: those of its forward before the layers' loop and of the loop's body before the call
    that these arguments depend on (not through the hidden states, which they read only for their dtype and
    device), run per stage call with the base model, the stage's hidden states and the position ids, then per layer
    with its index. `problem` names what they need that a stage does not have (None: nothing)."""

    def __init__(self, base_class: type, keywords: list[str]) -> None:
        self.keywords, self.problem, self.modules = keywords, None, []
        fn, at = _forward_tree(base_class)
        loop = fn.body[at]
        call = _layer_call(loop)
        values = {k.arg: k.value for k in call.keywords if k.arg in keywords}
        target = loop.target
        self.index = target.elts[0].id if isinstance(target, ast.Tuple) and isinstance(target.elts[0], ast.Name) \
            else None
        needed = set().union(*(_names(v)[0] for v in values.values()))  # (what is read and not yet made)
        body_at = next(k for k, st in enumerate(loop.body) if _layer_call(st, _loop_variable(loop)) is not None)
        per_layer = self._slice(loop.body[:body_at], needed)
        needed.discard(self.index)
        before = self._slice(fn.body[:at], needed)
        scope = vars(inspect.getmodule(base_class))
        missing = sorted(n for n in needed if n not in _REPLAY_INPUTS and n not in scope and not hasattr(builtins, n))
        if self.problem is None and missing:
            self.problem = f"its base model makes its layers' {', '.join(keywords)} from {', '.join(missing)}"
        if self.problem:
            return
        #: the base model's children these statements call or read (`self.rotary_embs`): shared by every stage
        self.modules = sorted({n.attr for st in before + per_layer for n in ast.walk(st) if isinstance(n, ast.Attribute)
                               and isinstance(n.value, ast.Name) and n.value.id == "self"})
        #: the statements replayed, as read (before the loop, then per layer)
        self.statements = [ast.unparse(st) for st in before + per_layer]
        where = f"<{base_class.__name__}.forward>"
        self._globals = scope
        self._before = compile(ast.Module(body=before, type_ignores=[]), where, "exec")
        self._per_layer = compile(ast.Module(body=per_layer, type_ignores=[]), where, "exec")
        self._values = {k: compile(ast.Expression(body=v), where, "eval") for k, v in values.items()}

    def _slice(self, statements: list[ast.stmt], needed: set[str]) -> list[ast.stmt]:
        """The statements among `statements` (in order) that bind a name in `needed`, which gains what they read."""
        kept = []
        for statement in reversed(statements):
            reads, binds, items = _names(statement)
            if not (binds | items) & (needed - set(_REPLAY_INPUTS)):
                continue
            if _assigns_hidden(statement) and self.problem is None:
                self.problem = (f"its base model makes its layers' {', '.join(self.keywords)} with its hidden states "
                                f"(`{ast.unparse(statement).splitlines()[0]}`)")
            kept.insert(0, statement)
            needed -= binds - items  # (a container filled item by item is still needed from where it is made)
            needed |= reads
        return kept

    def __call__(self, base: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> Callable[[int], dict]:
        """The keyword arguments of layer i, as a function of i, for this call."""
        scope = dict(self._globals, self=base, hidden_states=hidden, inputs_embeds=hidden, position_ids=position_ids)
        exec(self._before, scope)  # noqa: S102 - the base model's own statements, read from its source

        def arguments(i: int) -> dict:
            if self.index is not None:
                scope[self.index] = i
            exec(self._per_layer, scope)  # noqa: S102
            return {k: eval(v, scope) for k, v in self._values.items()}  # noqa: S307

        return arguments


def layer_replay(base: nn.Module) -> LayerReplay | None:
    """The replay of the layers' keyword arguments a stage does not make itself (beyond LAYER_ARGUMENTS, or
    position_embeddings other than the stage's tables: _TABLE_FORMS), or None where there are none."""
    found = _forward_tree(type(base))
    if found is None:
        return None
    call = _layer_call(found[0].body[found[1]])
    keywords = [k.arg for k in call.keywords if k.arg and (k.arg not in LAYER_ARGUMENTS or (
        k.arg == "position_embeddings" and ast.unparse(k.value) not in _TABLE_FORMS))]
    return LayerReplay(type(base), keywords) if keywords else None


def stage_plan(model) -> tuple[list[str], str, list[str]]:
    """(the base model's modules before the layers, the name of its list of layers (`layers`, GPT-J's `h`), its
    modules after them) as the config's base_model_pp_plan orders them; ContractError in one line naming what keeps
    the model from being staged."""
    config = model.config
    plan = getattr(config, "base_model_pp_plan", None) or {}

    def refuse(why: str) -> ContractError:
        return ContractError(f"pipeline_stage: {config.model_type} declares base_model_pp_plan "
                             f"({', '.join(plan) or 'none'}), but {why}")

    if not plan:
        raise refuse("there is no plan to map")
    names = list(plan)
    base, prefix = model.base, model.causal_lm.base_model_prefix
    blocks = [m for _, m in model.blocks()]
    found = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList) and list(getattr(base, n)) == blocks]
    if not found:
        raise refuse(f"it names no list of its repeated layers ({prefix}.{LAYERS} or another)" if LAYERS not in names
                     else f"{prefix}.{LAYERS} is not the list of its repeated layers")
    layers_name = found[0]
    if model.logit_fn is None:
        raise refuse(f"its forward changes the logits after the head ({model.logit_statements}) in a way the last "
                     "stage does not repeat")
    if model.head_input_fn is None:
        raise refuse(f"its forward changes the hidden states before the head ({model.head_input_statements}) in a "
                     "way the last stage does not repeat")
    ple = per_layer_input_modules(base)
    replay = layer_replay(base)
    if replay is not None and replay.problem:
        raise refuse(f"{replay.problem}, which a stage does not have")
    replayed = set(replay.keywords) if replay else set()
    extra = sorted(layer_arguments(type(base)) - LAYER_ARGUMENTS - replayed
                   - ({PER_LAYER_INPUT} if ple is not None else set()))
    if extra:
        raise refuse(f"its base model gives its layers {', '.join(extra)}, which a stage does not")
    shared = {ROTARY, *(replay.modules if replay else ())}
    for name, child in base.named_children():
        if name in (ple or ()):  # (the per-layer inputs' modules: on the first stage)
            continue
        if name not in names and name not in shared - {layers_name} and any(True for _ in child.parameters()):
            raise refuse(f"{prefix}.{name} holds parameters outside the plan")
        if name not in names and name not in shared | {layers_name} and any(True for _ in child.buffers()):
            raise refuse(f"{prefix}.{name} holds buffers outside the plan (only {ROTARY} and the modules that make "
                         "the layers' arguments from the positions are shared by stages)")
        if name in shared - {ROTARY} and any(True for _ in child.parameters()):
            raise refuse(f"{prefix}.{name}, which makes the layers' arguments from the positions, holds parameters")
    for name in names:
        if name != layers_name and getattr(base, name, None) is None:
            raise refuse(f"{prefix}.{name} is not a module of the base model")
    at = names.index(layers_name)
    _, problem = embedding_statements(type(base), names[:at], names[at + 1:])
    if problem:
        raise refuse(problem)
    return names[:at], layers_name, names[at + 1:]


#: The layer argument of Gemma's per-layer inputs (PLE), the base model's methods that make them (from the token ids
#: and the embedding's output: [b, s, layers, hidden_size_per_layer_input]) and the size that turns them on.
PER_LAYER_INPUT = "per_layer_input"
_PLE_METHODS = ("get_per_layer_inputs", "project_per_layer_inputs")


def per_layer_input_modules(base: nn.Module) -> list[str] | None:
    """The base model's modules that make its per-layer inputs (Gemma's PLE: the children its get_per_layer_inputs and
    project_per_layer_inputs call, e.g. embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm),
    where its forward gives each layer its slice of them as `per_layer_input` ([] where its config turns them off);
    None where it gives no such argument or lacks those methods."""
    if PER_LAYER_INPUT not in layer_arguments(type(base)) or not all(hasattr(base, m) for m in _PLE_METHODS):
        return None
    if not getattr(base.config, "hidden_size_per_layer_input", None):
        return []
    children = dict(base.named_children())
    called: list[str] = []
    for method in _PLE_METHODS:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(type(base), method))))
        except (OSError, TypeError, SyntaxError):
            return None
        for node in ast.walk(tree):  # (`self.<child>(...)` calls)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value,
                                                                                                   ast.Name)
                    and node.func.value.id == "self" and node.func.attr in children and node.func.attr not in called):
                called.append(node.func.attr)
    return called


def ple_rows(config, seq: int) -> int:
    """Positions appended to a [b, s, hidden] activation for its per-layer inputs [b, s, layers, d] (per batch row:
    s * layers * d values, zero-padded to whole positions); 0 without them."""
    d = getattr(config, "hidden_size_per_layer_input", None) or 0
    return math.ceil(seq * config.num_hidden_layers * d / config.hidden_size)


def pack_ple(x: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
    """`x` [b, s, h] with per-layer inputs [b, s, layers, d] appended as `ple_rows` positions (differentiable)."""
    b, _, h = x.shape
    flat = per_layer.reshape(b, -1).to(x.dtype)
    k = math.ceil(flat.shape[1] / h)
    flat = torch.cat([flat, flat.new_zeros(b, k * h - flat.shape[1])], dim=1)
    return torch.cat([x, flat.view(b, k, h)], dim=1)


def unpack_ple(x: torch.Tensor, seq: int, layers: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [b, n, h], per-layer inputs [b, seq, layers, d]) from an activation pack_ple made of a
    micro-batch of `seq` tokens (its hidden states may be a sequence shard of them: n <= seq)."""
    b, total, h = x.shape
    k = math.ceil(seq * layers * d / h)
    per_layer = x[:, total - k:].reshape(b, -1)[:, :seq * layers * d].reshape(b, seq, layers, d)
    return x[:, :total - k], per_layer


class HFPipelineStage(nn.Module, ModelContract):
    """Layers `layers` of an adapted causal LM (moe_lst.models.hf.HFCausalLM) as one pipeline stage, its modules
    under the model's names (`model.embed_tokens`, `model.layers.{i}`, `model.norm`, `lm_head`); the base model's
    rotary embedding (buffers only) on every stage. With a tied head the last stage also holds the embedding, so
    the pipeline keeps one copy per end and sums their gradients.

    forward(x, position_ids, packed=False): token ids on the first stage, else the hidden states from the stage
    before; returns hidden states, or logits (vocabulary-sliced under tensor parallelism, the model's own transform
    applied) on the last stage. The layers are called as the base model calls them: hidden states, no attention mask
    (the adapter's attention is causal, with each layer's window), position ids and, where the base model has one,
    the rotary embedding's tables of those positions, or what its replayed statements make of them (LayerReplay);
    a fresh shared_kv_states dict per call where the base model gives one; each layer's slice of the per-layer
    inputs where it has them (made on the first stage, sent on as `ple_rows` more positions after the hidden
    states).

    With a balancing loss (moe_lst.models.hf.balance) the activation sent on carries, after the hidden states,
    `stats_rows` more positions holding the micro-batch's per-expert sums over the layers so far (top-k counts,
    rows, and routing probabilities, these differentiable): each stage adds its own, and the last computes the
    loss over every layer from them, exactly as one process; the gradient of the probability sums comes back with
    the activation's."""

    def __init__(self, model, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        before, self.layers_name, after = stage_plan(model)
        shared = _kv_sharing_problem(model.config, layers)
        if shared:
            raise ContractError(f"pipeline_stage: {model.config.model_type}: {shared}")
        self.first, self.last, self.before, self.after = first, last, before, after
        #: what the base model does to the hidden states between its embedding and its layers (first stage)
        self.embedding_forms = embedding_statements(type(model.base), before, after)[0]
        #: where the base model gives its layers a dict they store keys and values in (a fresh one per call here)
        self.kv_sharing = "shared_kv_states" in layer_arguments(type(model.base))
        self.head_input_fn = model.head_input_fn  # (what the causal LM does to the hidden states before its head)
        self.balance = model.balance
        self.logit_fn = model.logit_fn  # (the model's own scaling / softcapping of the head's logits, elementwise)
        base, prefix = model.base, model.causal_lm.base_model_prefix
        self.prefix = prefix
        self.__dict__["base"] = base  # (read by the embedding forms: its multipliers and settings; not a child)
        inner = nn.Module()  # holds the base model's modules of this stage, under their names
        head = model.causal_lm.get_output_embeddings()
        tied = head.weight is base.get_input_embeddings().weight
        for name in before if first or (last and tied) else ():
            inner.add_module(name, getattr(base, name))
        #: the per-layer inputs' modules (Gemma's PLE; None: the base model has none), made on the first stage and
        #: sent on after the hidden states
        self.ple = per_layer_input_modules(base)
        for name in self.ple or () if first else ():
            inner.add_module(name, getattr(base, name))
        inner.add_module(self.layers_name, nn.ModuleDict({str(i): getattr(base, self.layers_name)[i] for i in layers}))
        for name in after if last else ():
            inner.add_module(name, getattr(base, name))
        #: the layers' keyword arguments made from the positions by the base model's own statements (or None)
        self.replay = layer_replay(base)
        for name in self.replay.modules if self.replay else ():
            if isinstance(getattr(base, name, None), nn.Module) and name != ROTARY:
                inner.add_module(name, getattr(base, name))  # (buffers only: shared by every stage)
        rotary = getattr(base, ROTARY, None)
        self.layer_types: list[str] | None = None
        if isinstance(rotary, nn.Module):
            inner.add_module(ROTARY, rotary)
            if "layer_type" in inspect.signature(rotary.forward).parameters:
                self.layer_types = list(model.config.layer_types)
        self.add_module(prefix, inner)
        head_name = next(n for n, m in model.causal_lm.named_children() if m is head)
        self.head_name = head_name
        if last:
            self.add_module(head_name, head)

    def blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"{self.prefix}.{self.layers_name}.{i}", layer) for i, layer in self._layers().items()]

    def _layers(self) -> nn.ModuleDict:
        return getattr(self._inner(), self.layers_name)

    def _rotary_tables(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The rotary embedding's tables of these positions: {None: table}, or {layer type: table} where its forward
        takes the layer type (as base models with per-type rope parameters call it); {} without one."""
        rotary = getattr(self._inner(), ROTARY, None)
        if rotary is None:
            return {}
        if not self.layer_types:
            return {None: rotary(x, position_ids=position_ids)}
        return {kind: rotary(x, position_ids, kind) for kind in set(self.layer_types)}

    def _inner(self) -> nn.Module:
        return getattr(self, self.prefix)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
        if position_ids is None:
            raise ValueError("pipeline stages need position_ids beside their input (pass them to every stage)")
        inner = self._inner()
        balance, incoming = self.balance, None
        if balance is not None:
            balance.begin(self.training and torch.is_grad_enabled())
            if balance.stats is not None and not self.last:  # (the gradient its sums get back is already scaled)
                balance.stats.scale = AttachedLossScale(1.0)
            if not self.first:
                x, incoming = unpack_stats(x, balance.num_experts)
        per_layer = None  # (the per-layer inputs: [b, s, layers, d])
        if self.first:
            tokens = x
            for name in self.before:
                x = getattr(inner, name)(x)
            if self.ple:  # (as the base model's forward: from the token ids and the embedding's output)
                per_layer = self.base.project_per_layer_inputs(x, self.base.get_per_layer_inputs(tokens, x))
            for form in self.embedding_forms:
                x = form(self.base, x, self.training)
        elif self.ple:
            config = self.base.config
            x, per_layer = unpack_ple(x, position_ids.shape[1], config.num_hidden_layers,
                                      config.hidden_size_per_layer_input)
        kwargs = dict(attention_mask=None, position_ids=position_ids, use_cache=False)
        if self.kv_sharing:  # (as the base model's forward: one dict for the layers of this call)
            from transformers.cache_utils import KVSharingDict

            kwargs["shared_kv_states"] = KVSharingDict()
        replayed = self.replay(self.base, x, position_ids) if self.replay else None
        tables = {} if self.replay and "position_embeddings" in self.replay.keywords else self._rotary_tables(
            x, position_ids)
        if packed:
            kwargs["documents"] = Documents(position_ids)  # attention stays inside each packed document
        token = hf_attn.PACKED.set(packed)
        try:
            for i, layer in self._layers().items():
                if tables:  # (per layer type where the base model keeps a table for each)
                    kwargs["position_embeddings"] = tables[self.layer_types[int(i)] if self.layer_types else None]
                if replayed is not None:
                    kwargs.update(replayed(int(i)))
                if self.ple is not None:  # (its slice of the per-layer inputs, or None where they are off)
                    out = layer(x, None if per_layer is None else per_layer[:, :, int(i), :], **kwargs)
                else:
                    out = layer(x, **kwargs)
                x = out[0] if isinstance(out, tuple) else out
        finally:
            hf_attn.PACKED.reset(token)
        if per_layer is not None and not self.last:
            x = pack_ple(x, per_layer)
        if self.last:
            for name in self.after:
                x = getattr(inner, name)(x)
            x = self.logit_fn(getattr(self, self.head_name)(self.head_input_fn(x)))
            if balance is not None:
                x = _finish_balance(balance, x, incoming)
        elif balance is not None:
            x = _pass_balance(balance, x, incoming)
        return x.contiguous()  # sent to the next stage as it is


# ---------------------------------------------------------------------------- the balancing loss over stages
def stats_rows(num_experts: int, batch: int, hidden: int) -> int:
    """Positions appended to a [batch, s, hidden] activation for the sums of `num_experts` experts: E probability
    sums (in the activation's dtype, differentiable), then E counts and the row count as float32 bits (two
    elements each in a 16-bit dtype, so they stay exact), zero-padded."""
    return math.ceil((3 * num_experts + 2) / (batch * hidden))


def pack_stats(x: torch.Tensor, prob_sum: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """`x` [b, s, h] with the sums appended as `stats_rows` positions: `prob_sum` [E] (its gradient flows back
    through the concatenation), `exact` [E + 1] float32 (counts, rows)."""
    b, _, h = x.shape
    e = prob_sum.numel()
    bits = exact.to(x.dtype) if x.element_size() >= 4 else exact.contiguous().view(x.dtype)
    flat = torch.cat([prob_sum.to(x.dtype), bits.detach()])
    k = stats_rows(e, b, h)
    flat = torch.cat([flat, flat.new_zeros(b * k * h - flat.numel())])
    return torch.cat([x, flat.view(b, k, h)], dim=1)


def unpack_stats(x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states, (probability sums [E] float32, differentiable; counts and rows [E + 1] float32)) from an
    activation `pack_stats` made."""
    b, n, h = x.shape
    k = stats_rows(num_experts, b, h)
    flat = x[:, n - k:].reshape(-1)
    prob_sum = flat[:num_experts].float()
    if x.element_size() >= 4:
        exact = flat[num_experts:2 * num_experts + 1].detach().float()
    else:
        exact = flat[num_experts:3 * num_experts + 2].detach().clone().view(torch.float32)
    return x[:, :n - k].contiguous(), (prob_sum, exact)


class _Carry(torch.autograd.Function):
    """(hidden, a copy of this stage's probability sums) in forward; backward hands the gradient those sums get
    (from the stages after) to this stage's routers (`stats.grad_weights`) and makes the micro-batch's statistics
    the balancing loss's current ones again, for the layers a checkpoint recomputes in this backward (micro-batches
    interleave under a pipeline schedule). It follows every layer of the stage, so its backward runs before
    theirs."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, prob_sum: torch.Tensor, stats, balance) -> tuple[torch.Tensor, ...]:
        ctx.stats, ctx.balance = stats, balance
        return hidden.view_as(hidden), prob_sum.clone()

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor, grad_prob: torch.Tensor):
        ctx.stats.grad_weights = grad_prob.float()
        ctx.balance.stats = ctx.stats
        return grad_hidden, None, None, None


class _Resume(torch.autograd.Function):
    """The last stage's output unchanged; backward makes its micro-batch's statistics the balancing loss's current
    ones again (as _Carry), before any of its layers is recomputed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stats, balance) -> torch.Tensor:
        ctx.stats, ctx.balance = stats, balance
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.balance.stats = ctx.stats
        return grad, None, None


def _pass_balance(balance, x: torch.Tensor, incoming) -> torch.Tensor:
    """A stage before the last: its sums added to those received, appended to its hidden states."""
    e = balance.num_experts
    s = balance.stats
    prob_sum = torch.zeros(e, dtype=torch.float32, device=x.device)
    exact = torch.zeros(e + 1, dtype=torch.float32, device=x.device)
    if s is not None:
        if s.rows:
            exact = torch.cat([s.counts, s.prob_sum.new_tensor([float(s.rows)])]).to(x.device)
        x, own = _Carry.apply(x, s.prob_sum.to(x.device), s, balance)
        prob_sum = prob_sum + own
    if incoming is not None:
        prob_sum, exact = prob_sum + incoming[0], exact + incoming[1]
    balance.stats = None  # (this micro-batch's forward is done; the next begins its own)
    return pack_stats(x, prob_sum, exact)


def _finish_balance(balance, logits: torch.Tensor, incoming) -> torch.Tensor:
    """The last stage: the loss over every stage's sums (as BalancingLoss.finish over one process's layers), its
    gradient to this stage's routers and, through the logits, into the sums received."""
    s, e = balance.stats, balance.num_experts
    balance.stats = None
    if s is None:
        return logits
    counts, prob_sum = s.counts.to(logits.device), s.prob_sum.to(logits.device)
    rows = torch.tensor([float(s.rows)], device=logits.device)
    if incoming is not None:
        counts, rows = counts + incoming[1][:e], rows + incoming[1][e:]
        prob_sum = prob_sum + incoming[0].detach()
    totals = torch.cat([counts, prob_sum, rows])
    comm.all_reduce(totals, balance.sp_group)
    counts, prob_sum, rows = totals[:e], totals[e:-1], totals[-1]
    if not float(rows):
        return logits
    s.grad_weights = balance.coef * e * counts / rows**2
    balance.last_value = float(torch.sum((counts / rows) * (prob_sum / rows)) * e)
    if incoming is not None and incoming[0].requires_grad:
        logits = attach_loss(logits, torch.sum(s.grad_weights * incoming[0]), balance.scale)
    return _Resume.apply(logits, s, balance) if logits.requires_grad else logits


def pipeline_shapes(model, tokens_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activation between stages, last stage's output) for a micro-batch of tokens [b, s]: hidden [b, s / tp,
    hidden_size] (sequence-parallel shards under tensor parallelism; with per-layer inputs `ple_rows` more positions
    carry them, then with a balancing loss `stats_rows` more its sums) and logits [b, s, vocab / tp]."""
    b, s = tokens_shape
    local_vocab = model.output_weight.shape[0]
    tp = model.config.vocab_size // local_vocab
    hidden = model.config.hidden_size
    extra = 0 if model.balance is None else stats_rows(model.balance.num_experts, b, hidden)
    if per_layer_input_modules(model.base):
        extra += ple_rows(model.config, s)
    return (b, s // tp + extra, hidden), (b, s, local_vocab)
