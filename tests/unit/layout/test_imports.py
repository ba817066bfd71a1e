"""bandpo.algo and bandpo.reward must import without ray, vllm, deepspeed or peft."""

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'ray', 'vllm', 'deepspeed', 'peft'}:
            raise ImportError('blocked heavy import: ' + name)
sys.meta_path.insert(0, Block())
import bandpo.algo, bandpo.reward
print('ok')
"""


def test_algo_and_reward_import_without_heavy_engines():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


GPU_SMOKE_IMPORTS = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'ray', 'vllm', 'math_verify', 'pebble', 'datasets', 'wandb', 'peft'}:
            raise ImportError('blocked import: ' + name)
sys.meta_path.insert(0, Block())
from bandpo.config import compose
from bandpo.distributed.memory import memory_estimate
from bandpo.distributed.plan import ClusterShape, make_plan
import bandpo.actor, bandpo.actor.offload
cfg = compose(["model=qwen2.5-3b"])
memory_estimate(cfg, make_plan(cfg, ClusterShape(1, 8), "cuda"))
print('ok')
"""


def test_config_plan_and_actor_import_with_torch_and_deepspeed_alone():
    # What bandpo.tools.gpu_smoke needs: a lent GPU machine has torch, transformers and carried DeepSpeed,
    # Hydra wheels, but no Ray, vLLM or verifier (too large to carry, or not needed to train).
    out = subprocess.run(
        [sys.executable, "-c", GPU_SMOKE_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
