"""A stand-in for the ``sglang`` package (SGLang needs the CUDA 13 stack and cannot run on this machine) that
follows its documented offline Engine API and checks the arguments as SGLang does: ``Engine(**server_args)``,
``generate(input_ids=..., sampling_params=..., return_logprob=True)`` returning one dict per input with
``output_ids`` and ``meta_info`` (``output_token_logprobs`` as ``(logprob, token_id, text)``, ``finish_reason``
as ``{"type": ...}``), ``update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``,
``release_memory_occupation`` / ``resume_memory_occupation`` (only with ``enable_memory_saver``), ``shutdown``.

It generates for real with the checkpoint's transformers model: temperature sampling with the per-request
``sampling_seed``, and the sampled token's ``log_softmax(logits / temperature)`` as its log-prob (the sampler's
log-prob, which SGLang reports since its PR 2664), stopping after a stop token (kept: ``no_stop_trim``) or at
``max_new_tokens``."""

from __future__ import annotations

import types

import torch

SERVER_ARGS = {  # sglang.srt.server_args.ServerArgs fields the adapter may pass
    "model_path", "tokenizer_path", "dtype", "random_seed", "mem_fraction_static", "tp_size", "context_length",
    "skip_tokenizer_init", "enable_memory_saver", "log_level", "trust_remote_code", "attention_backend",
    "disable_cuda_graph", "max_running_requests",
}
SAMPLING_KEYS = {  # the documented sampling parameters
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "sampling_seed", "logit_bias",
}


class Engine:
    instances: list["Engine"] = []

    def __init__(self, **kwargs):
        from transformers import AutoModelForCausalLM

        unknown = set(kwargs) - SERVER_ARGS
        assert not unknown, f"sglang ServerArgs has no field(s) {unknown}"
        assert "model_path" in kwargs
        self.kwargs, self.calls = kwargs, []
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[kwargs.get("dtype", "auto")]
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=dtype).eval()
        self.released = False
        Engine.instances.append(self)

    @torch.no_grad()
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **rest):
        assert prompt is None and input_ids is not None, "the adapter sends token ids (skip_tokenizer_init)"
        assert not self.released, "generate while the memory is released"
        sp = dict(sampling_params or {})
        assert set(sp) <= SAMPLING_KEYS, f"unknown sampling parameter(s) {set(sp) - SAMPLING_KEYS}"
        assert sp.get("top_k", -1) == -1 or sp["top_k"] >= 1
        self.calls.append(("generate", len(input_ids), sp))
        single = bool(input_ids) and isinstance(input_ids[0], int)
        rows = [input_ids] if single else input_ids
        stops = set(sp.get("stop_token_ids") or ())
        temperature = float(sp.get("temperature", 1.0))
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)))
        outs = []
        for ids in rows:
            seq, out_ids, entries, reason = list(ids), [], [], "length"
            for _ in range(int(sp.get("max_new_tokens", 128))):
                logits = self.model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                logp = torch.log_softmax(logits / (temperature or 1.0), -1)
                tok = int(logits.argmax()) if temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                out_ids.append(tok)
                entries.append((float(logp[tok]), tok, None))
                seq.append(tok)
                if tok in stops:
                    reason = "stop"
                    break
            outs.append({"output_ids": out_ids, "meta_info": {
                "output_token_logprobs": entries if return_logprob else None,
                "finish_reason": {"type": reason}, "prompt_tokens": len(ids), "completion_tokens": len(out_ids)}})
        return outs[0] if single else outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format is None and all(isinstance(t, torch.Tensor) for _, t in named_tensors)
        params = self.model.state_dict(keep_vars=True)  # tied weights under both names, as load_weights takes them
        for name, tensor in named_tensors:
            params[name].data.copy_(tensor)
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        return True, "Succeeded to update model weights."

    def release_memory_occupation(self, tags=None):
        assert self.kwargs.get("enable_memory_saver"), "SGLang needs enable_memory_saver=True to release memory"
        self.released = True
        self.calls.append(("release_memory_occupation",))

    def resume_memory_occupation(self, tags=None):
        self.released = False
        self.calls.append(("resume_memory_occupation",))

    def shutdown(self):
        self.calls.append(("shutdown",))


def module() -> types.ModuleType:
    mod = types.ModuleType("sglang")
    mod.__version__ = "0.5.9-fake"
    mod.Engine = Engine
    return mod
