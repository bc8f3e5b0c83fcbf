"""Run under torchrun: ShardEma on an FSDP2-sharded (``fully_shard``) model against an unsharded twin.

Both twins take the same SGD steps; every rank checks that the EMA, its swap-in forward pass, the restored
weights and a save/load round trip of the sharded EMA match the whole-tensor EMA.
"""
import copy
import sys
from pathlib import Path

import timm
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import lipsformer  # noqa: F401
from lipsformer.engine.ema import ShardEma

dist.init_process_group("gloo")
torch.manual_seed(0)
whole = timm.create_model("lipsformer_swin_t", num_classes=4, img_size=32, embed_dim=16, depths=(1, 1, 1, 1),
                          num_heads=(1, 2, 4, 8), window_size=2, drop_path_rate=0.0)
sharded = copy.deepcopy(whole)
for stage in sharded.stages:
    fully_shard(stage)
fully_shard(sharded)
assert any(hasattr(p, "device_mesh") for p in sharded.parameters())
ema_whole, ema_sharded = ShardEma(whole, 0.5), ShardEma(sharded, 0.5)
opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (whole, sharded)]
x = torch.randn(2, 3, 32, 32)
for step in range(1, 4):
    for model, opt in zip((whole, sharded), opts):
        opt.zero_grad()
        model(x).square().mean().backward()  # the same batch on every rank: averaged gradients are unchanged
        opt.step()
    ema_whole.update(whole, step)
    ema_sharded.update(sharded, step)


def close(a, b):
    return all(torch.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(a, b))


full = ema_sharded.state_dict()["average"]
assert close(full, ema_whole.state_dict()["average"]), "EMA differs"
assert not close(full, [p.detach() for p in whole.parameters()]), "EMA equals the weights: nothing averaged"
whole.eval(), sharded.eval()
with ema_whole.applied(whole), ema_sharded.applied(sharded):
    assert torch.allclose(whole(x), sharded(x), rtol=1e-5, atol=1e-6), "forward with the EMA differs"
assert close([p.full_tensor() for p in sharded.parameters()], list(whole.parameters())), "weights not restored"
whole.train(), sharded.train()
assert torch.allclose(whole(x), sharded(x), rtol=1e-5, atol=1e-6), "training forward after the swap differs"
restored = ShardEma(sharded, 0.5)
restored.load_state_dict(ema_sharded.state_dict())
assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(restored.average, ema_sharded.average))
Path(sys.argv[1], f"rank_{dist.get_rank()}.ok").write_text("ok")
dist.destroy_process_group()
