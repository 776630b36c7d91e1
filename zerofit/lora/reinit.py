"""Replaying the random init of a ZeRO-3 build, one module at a time.

A LoRA run on `model.config` trains on a base nobody saved. engine.build_model seeds the RNG
with train.seed and builds under deepspeed.zero.Init; transformers (5.x, modeling_utils
`_from_config`) then constructs the model with init switched off (initialization.
no_init_weights), and `integrations.deepspeed.initialize_weights_zero3` walks the modules
children first: per module it gathers the module's own parameters and those of its direct
children that are not sub-models (full tensors, on the accelerator), runs the model's
`_initialize_weights` on rank 0, and scatters the result; last, `tie_weights`. So the values
depend on the seed, the dtype, the walk and the device whose RNG drew them (the CPU and CUDA
generators differ), not on the world size: rank 0 draws everything.

`InitReplay` runs that same walk on a meta skeleton built the same way, with real tensors
only for what the current step gathers. A parameter is final once the last module gathering
it (its module's parent) has run; it is then handed out and dropped, so the replay holds at
most about one decoder layer and the largest embedding, never the model. The fingerprint a
LoRA checkpoint records (basemodel.py) proves the replay right or refuses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerofit.core.errors import ConfigError


@dataclass
class Step:
    """One `_initialize_weights` call of the walk."""
    module: torch.nn.Module
    init_fn: object                               # the owning sub-model's _initialize_weights
    gathered: list[int] = field(default_factory=list)   # parameter keys it gathers
    final: list[int] = field(default_factory=list)      # keys no later step gathers


class InitReplay:
    """The random-init base of a ZeRO-3 build, parameter by parameter in the order the walk
    finishes them: iterate for (name, CPU tensor in the training dtype)."""

    def __init__(self, hf_config, dtype: torch.dtype, seed: int, device: str = "cpu",
                 trust_remote_code: bool = False):
        try:
            from transformers import initialization
        except ImportError:
            raise ConfigError("rebuilding a random-init base needs transformers >= 5 (its ZeRO-3 init walk); "
                              "install it, or train LoRA from model.path") from None
        from transformers import AutoModelForCausalLM

        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("this run's random-init base was drawn by the GPU's RNG (CUDA), which the CPU cannot "
                              "reproduce; run this on a machine with a GPU")
        self.seed, self.dtype = seed, dtype
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        with initialization.no_init_weights(), torch.device("meta"):  # as under zero.Init: nothing drawn yet
            self.model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
        self._initialization = initialization
        self._meta: dict[int, torch.nn.Parameter] = {}
        self._homes: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        self.names: dict[int, str] = {}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                key = id(p)
                self._meta[key] = p
                self._homes.setdefault(key, []).append((module, attr))
                self.names.setdefault(key, f"{module_name}.{attr}" if module_name else attr)
        self.steps = self._plan()

    # ------------------------------------------------------------------ the walk
    def _plan(self) -> list[Step]:
        """initialize_weights_zero3's order: children first, a sub-model's own init function
        for its subtree; each step gathers its own and its plain children's parameters."""
        from transformers import PreTrainedModel

        steps = []

        def visit(module, init_fn):
            for child in module.children():
                visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else init_fn)
            params = list(module.parameters(recurse=False))
            for child in module.children():
                if not isinstance(child, PreTrainedModel):
                    params.extend(child.parameters(recurse=False))
            keys = list(dict.fromkeys(id(p) for p in params))
            steps.append(Step(module, init_fn, keys))

        visit(self.model, self.model._initialize_weights)
        last = {key: i for i, step in enumerate(steps) for key in step.gathered}
        for key, i in last.items():
            steps[i].final.append(key)
        return steps

    @property
    def order(self) -> list[str]:
        """Parameter names in the order the replay hands them out."""
        return [self.names[key] for step in self.steps for key in step.final]

    def host_peak_bytes(self) -> int:
        """Most host RAM the replay holds at once. On the CPU: what is gathered or waiting for
        a later step. On a GPU those sit in GPU memory and the host holds the CPU copy of one
        finished parameter at a time."""
        sizes = {key: p.numel() * p.element_size() for key, p in self._meta.items()}
        if self.device.type == "cuda":
            return max(sizes.values(), default=0)
        live, peak = set(), 0
        for step in self.steps:
            live.update(step.gathered)
            peak = max(peak, sum(sizes[k] for k in live))
            live.difference_update(step.final)
        return peak

    def __iter__(self):
        is_remote = getattr(self.model, "is_remote_code", lambda: False)()
        torch.manual_seed(self.seed)  # engine.build_model seeds right before the build; nothing draws in between
        with torch.no_grad(), self._initialization.guard_torch_init_functions():
            for step in self.steps:
                for key in step.gathered:
                    self._materialize(key)
                step.init_fn(step.module, is_remote)
                for key in step.final:
                    value = self._home_value(key)
                    self._release(key)
                    yield self.names[key], value.to("cpu")

    def _materialize(self, key: int) -> None:
        meta = self._meta[key]
        module, attr = self._homes[key][0]
        if module._parameters[attr] is not meta:
            return  # gathered by an earlier step and still waiting
        real = torch.nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self.device),
                                  requires_grad=meta.requires_grad)
        for module, attr in self._homes[key]:
            module._parameters[attr] = real

    def _home_value(self, key: int) -> torch.Tensor:
        module, attr = self._homes[key][0]
        return module._parameters[attr].data

    def _release(self, key: int) -> None:
        for module, attr in self._homes[key]:
            module._parameters[attr] = self._meta[key]


def can_replay() -> bool:
    """Whether this transformers has the ZeRO-3 init walk InitReplay mirrors (5.x)."""
    import importlib.util

    return importlib.util.find_spec("transformers.initialization") is not None


def build_model(hf_config, dtype: torch.dtype, seed: int, device: str = "cpu", trust_remote_code: bool = False):
    """The whole random-init base in memory (chat, --verify): the replay's values loaded into
    a model built without init, then tied as from_config ties it. Returns (model, values)."""
    from transformers import AutoModelForCausalLM, initialization

    values = dict(InitReplay(hf_config, dtype, seed, device, trust_remote_code))
    with initialization.no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.load_state_dict(values, strict=False, assign=False)
    model.tie_weights()
    return model, values
