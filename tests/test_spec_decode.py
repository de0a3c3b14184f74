"""Which drafter tables vLLM replaces with the target's (layer.replaced_by_target), checked
against vLLM's own sharing code on small modules."""

from types import SimpleNamespace

import pytest
import torch

from vllm_embed_plugin.layer import replaced_by_target


def config(method, pp=1):
    spec = None if method is None else SimpleNamespace(method=method)
    return SimpleNamespace(
        speculative_config=spec,
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
    )


def vllm_shares(proposer_cls, pp, monkeypatch) -> bool:
    """Run vLLM's `_maybe_share_embeddings` of `proposer_cls` on a drafter without an EAGLE
    checkpoint flag (as vLLM's MTP models are built); whether it took the target's table."""
    from vllm.v1.spec_decode import llm_base_proposer

    monkeypatch.setattr(llm_base_proposer, "get_pp_group", lambda: SimpleNamespace(world_size=pp))
    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.embed_tokens = torch.nn.Embedding(16, 8)
    drafter = SimpleNamespace(model=torch.nn.Module())
    drafter.model.model = torch.nn.Module()
    drafter.model.model.embed_tokens = torch.nn.Embedding(16, 8)
    proposer_cls._maybe_share_embeddings(drafter, target)
    return drafter.model.model.embed_tokens is target.model.embed_tokens


@pytest.mark.parametrize("pp", [1, 2])
def test_an_mtp_drafter_table_is_replaced_exactly_where_vllm_shares_it(pp, monkeypatch):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    assert replaced_by_target(config("mtp", pp)) == vllm_shares(
        SpecDecodeBaseProposer, pp, monkeypatch
    )
    assert replaced_by_target(config("mtp", pp)) == (pp == 1)


def test_a_separate_draft_model_keeps_its_own_table(monkeypatch):
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    assert not vllm_shares(DraftModelProposer, 1, monkeypatch)
    assert not replaced_by_target(config("draft_model"))
    assert not replaced_by_target(config(None))
    # EAGLE: vLLM decides after loading, from the checkpoint; never assumed here.
    assert not replaced_by_target(config("eagle"))
