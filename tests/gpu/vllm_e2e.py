"""On the GPU machine, with vLLM (the bundle's activate.sh): a PyTorch trainer publishes into
real vLLM through wsync and checks what vLLM then computes.

A small Qwen3-MoE from transformers (tests/fixtures/models/gpu_tiny, random init, no
download) is sharded with FSDP2 on one rank and trained for three AdamW steps; the session
runs in this process (wsync.Host) and vLLM serves the same config.json with dummy weights
until the first publication. Before the first publication and after each, the prompt
log-probabilities that vLLM gives a fixed token sequence are compared with the trainer's own
forward pass over its updated parameters.

Tolerance. The weights are the same bfloat16 bits on both sides, but the kernels are not
(FlashAttention against torch's attention, vLLM's fused MoE against transformers' expert
loop, other accumulation orders), and bfloat16 keeps 8 bits of mantissa; with logits as
large as these (see below) that is tenths of a nat on some tokens. So both are measured
against the same parameters in float32 (a copy of the trainer's, unsharded): vLLM's
distance from that reference must be within 4x the trainer's own bfloat16 distance from it,
plus 0.005 nat (mean over the sequence) and 0.02 nat (max). A wrong weight is far outside:
before the first publication (vLLM's dummy weights) the mean difference from the trainer
must be at least 0.2 nat, and the trainer's embeddings and head are scaled so that its
distribution is far from uniform.

Also checked: the version stamped on each generation moves with each publication; the
first publication of the direct mode checks the loader plan against vLLM's own loader; and
the prefix cache: the sequence generated twice before a publication reads its full blocks
from the cache the second time, and generated after it reads none (no block computed under
the old weights is served).

FP8 rollout (``--load direct-fp8`` and ``native-fp8``: vLLM's online per-tensor FP8 of the
trainer's bfloat16, runtime.vllm.quantization = "fp8"). FP8 weights are further from the
float32 reference than bfloat16, so the bound above cannot hold; the rollout's distance is
bounded instead by what FP8 weights alone explain: the same float32 reference with each
weight vLLM quantizes (every matrix but the embeddings and the head) rounded per tensor (per
expert for the experts' tensors) to float8_e4m3fn and back, as vLLM's scale amax/448 does.
vLLM's distance from float32 must be within NOISE_FACTOR x the trainer's bfloat16 distance
plus FP8_FACTOR x that FP8 distance, plus the slacks (FP8_FACTOR leaves room for what the
weights alone do not model: vLLM also quantizes activations per token). The mismatch against
the bfloat16 trainer is printed beside the bfloat16 figure. direct-fp8 checks every
publication against vLLM's own FP8 loader (check = "every"): vLLM reloads the same bfloat16
and the resident bytes must be equal, so its log-probabilities are the ones vLLM's own FP8
path gives on the same weights; the test fails unless every publication was checked whole.

    python3 tests/gpu/vllm_e2e.py [--load direct|native|direct-sleep|direct-fp8|native-fp8]
(direct-sleep: vLLM sleeps at level 1 at bootstrap and at level 2 before each publication,
then wakes its weights for it and its KV cache after it.)
Prints one line per step and "vllm_e2e: ok"; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import sys

import torch
from transformers import Qwen3MoeForCausalLM
from vllm_trainer import Trainer, verdict

import wsync

RECIPES = {"direct": "tests/fixtures/recipes/vllm_tiny_cuda.lua",
           "native": "tests/fixtures/recipes/vllm_tiny_cuda_native.lua",
           "direct-sleep": "tests/fixtures/recipes/vllm_tiny_cuda_sleep.lua",
           "direct-fp8": "tests/fixtures/recipes/vllm_tiny_cuda_fp8.lua",
           "native-fp8": "tests/fixtures/recipes/vllm_tiny_cuda_native_fp8.lua"}
STEPS = 3
#: vLLM's distance from the float32 reference: at most NOISE_FACTOR x the trainer's own, plus
#: these (nat, mean and max over the sequence); BEFORE_DELTA: the least mean distance of
#: vLLM's dummy weights from the trainer.
NOISE_FACTOR, MEAN_SLACK, MAX_SLACK, BEFORE_DELTA = 4.0, 0.005, 0.02, 0.2
#: FP8 rollouts: the factor on the distance that FP8 weights alone give (see the module's doc).
FP8_FACTOR = 4.0
#: The largest magnitude of float8_e4m3fn.
FP8_MAX = 448.0


def trainer_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()


def vllm_logprobs(host: wsync.Host, tokens: list[int]) -> tuple[int, list[float]]:
    result = host.generate([tokens], max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = result["outputs"][0]
    if output["model_version"] != result["model_version"]:
        raise AssertionError(f"an output stamped {output['model_version']} in a result of {result['model_version']}")
    return result["model_version"], [float(value) for value in output["prompt_logprobs"][1:]]


def cached_tokens(host: wsync.Host, tokens: list[int], twice: bool = False) -> int:
    """How many of ``tokens`` vLLM took from its prefix cache for a one-token generation
    (the second of two when ``twice``: the first fills the cache)."""
    for _ in range(2 if twice else 1):
        output = host.generate([tokens], max_tokens=1, temperature=0.0)["outputs"][0]
    return int(output["cached_tokens"])


def float32_copy(model: torch.nn.Module, reference: torch.nn.Module) -> torch.nn.Module:
    """``reference`` (an unsharded model of the same config, float32) holding the trainer's
    current parameters."""
    state = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        state[name] = full.detach().float()
    reference.load_state_dict(state)
    return reference


def fp8_rounded(reference: torch.nn.Module) -> torch.nn.Module:
    """``reference`` with each weight vLLM's online FP8 quantizes (every matrix but the
    embeddings and the head) rounded to float8_e4m3fn and back under vLLM's per-tensor scale
    amax/448, one scale per expert for the experts' stacked tensors."""
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if parameter.dim() < 2 or "embed_tokens" in name or name.startswith("lm_head"):
                continue
            pieces = parameter.data if parameter.dim() > 2 else parameter.data[None]
            for piece in pieces:
                scale = piece.abs().amax() / FP8_MAX
                if scale > 0:
                    piece.copy_((piece / scale).to(torch.float8_e4m3fn).float() * scale)
    return reference


def deltas(a: list[float], b: list[float]) -> tuple[float, float]:
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} log-probabilities against {len(b)}")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return max(diffs), sum(diffs) / len(diffs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--load", choices=sorted(RECIPES), default="direct")
    load = parser.parse_args().load
    recipe = RECIPES[load]
    fp8 = load.endswith("-fp8")

    def scaled(model: torch.nn.Module) -> None:  # a distribution far from uniform (see the module's doc)
        model.model.embed_tokens.weight.mul_(40)
        model.lm_head.weight.mul_(40)
    trainer = Trainer(scaled)
    config, model = trainer.config, trainer.model
    reference = Qwen3MoeForCausalLM(config).to("cuda", torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, config.vocab_size, (48,), generator=generator).tolist()
    failures = []

    with wsync.Host(recipe) as host:
        agent = trainer.agent(host)
        if load == "direct-sleep":  # (asleep since the bootstrap: nothing to generate with before a publication)
            print("vllm_e2e: before any publication: vLLM sleeps (level 1 at bootstrap)", flush=True)
        else:
            version, before = vllm_logprobs(host, sequence)
            worst, mean = deltas(before, trainer_logprobs(model, sequence))
            print(f"vllm_e2e: before any publication: version {version}, mean |delta| {mean:.4f}, max {worst:.4f}",
                  flush=True)
            if version != 0 or mean < BEFORE_DELTA:
                failures.append(f"before publication: version {version}, mean |delta| {mean:.4f} (want >= "
                                f"{BEFORE_DELTA})")
        for step in range(1, STEPS + 1):
            loss = trainer.step()
            if load != "direct-sleep" or step > 1:
                cached_before = cached_tokens(host, sequence, twice=True)
            publication = agent.publish(step)
            if load != "direct-sleep" or step > 1:
                cached_after = cached_tokens(host, sequence)
                print(f"vllm_e2e: step {step}: prefix cache: the sequence's second run before the publication took "
                      f"{cached_before} tokens from it, its first run after {cached_after}", flush=True)
                if cached_before < len(sequence) // 16 * 16 - 16 or cached_after != 0:
                    failures.append(f"step {step}: prefix cache hits {cached_before} before the publication (want the "
                                    f"sequence's full blocks) and {cached_after} after it (want 0: blocks of the old "
                                    "weights must not be read)")
            version, got = vllm_logprobs(host, sequence)
            ours = trainer_logprobs(model, sequence)
            exact = trainer_logprobs(float32_copy(model, reference), sequence)
            worst, mean = deltas(got, exact)
            noise_worst, noise_mean = deltas(ours, exact)
            apart_worst, apart_mean = deltas(got, ours)
            fp8_worst = fp8_mean = 0.0
            if fp8:
                fp8_worst, fp8_mean = deltas(trainer_logprobs(fp8_rounded(reference), sequence), exact)
                print(f"vllm_e2e: step {step}: FP8 rollout against the bfloat16 trainer, mean/max |delta| "
                      f"{apart_mean:.4f}/{apart_worst:.4f}; from float32: FP8 rollout {mean:.4f}/{worst:.4f}, "
                      f"bfloat16 trainer {noise_mean:.4f}/{noise_worst:.4f}, FP8 weights alone {fp8_mean:.4f}/"
                      f"{fp8_worst:.4f}", flush=True)
            print(f"vllm_e2e: step {step}: loss {loss:.4f}, model version {publication.model_version} "
                  f"(generation stamped {version}); |delta| from float32, mean/max: vLLM {mean:.4f}/{worst:.4f}, "
                  f"trainer (bfloat16) {noise_mean:.4f}/{noise_worst:.4f}; vLLM from trainer {apart_mean:.4f}/"
                  f"{apart_worst:.4f}", flush=True)
            if version != publication.model_version:
                failures.append(f"step {step}: generation stamped {version}, published {publication.model_version}")
            mean_bound = NOISE_FACTOR * noise_mean + FP8_FACTOR * fp8_mean + MEAN_SLACK
            max_bound = NOISE_FACTOR * noise_worst + FP8_FACTOR * fp8_worst + MAX_SLACK
            if mean > mean_bound or worst > max_bound:
                failures.append(f"step {step}: vLLM's |delta| from float32, mean {mean:.4f} max {worst:.4f}, beyond "
                                f"{mean_bound:.4f} / {max_bound:.4f} ({NOISE_FACTOR}x the trainer's own"
                                + (f" and {FP8_FACTOR}x FP8 weights' alone" if fp8 else "")
                                + f", plus {MEAN_SLACK} / {MAX_SLACK})")
        reports = host.reports()
        if load.startswith("direct"):  # (the first publication's check against vLLM's loader, and only the first;
            # under FP8 every publication's, each whole)
            checked = [[bool(receipt.get("checked_against_vllm")) and not receipt.get("unchecked_tensors")
                        for receipt in report["receipts"]] for report in reports]
            print(f"vllm_e2e: checked against vLLM's own loader, by publication and TP rank: {checked}", flush=True)
            if fp8 and checked != [[True]] * len(reports):
                failures.append(f"the direct FP8 loader's check against vLLM's own FP8 loader ran whole in {checked}, "
                                "not in every publication")
            elif not fp8 and checked != [[True]] + [[False]] * (len(reports) - 1):
                failures.append(f"the direct loader's check against vLLM's own loader ran in {checked}, not in the "
                                "first publication alone")
        for report in reports:
            timings = report["timings"]
            print(f"vllm_e2e: version {report['model_version']}: total {timings['total'] * 1e3:.1f} ms (fill "
                  f"{timings['fill'] * 1e3:.1f}, load {timings['load'] * 1e3:.1f}, finish "
                  f"{timings['finish'] * 1e3:.1f})", flush=True)
    trainer.close()
    return verdict("vllm_e2e", failures, f"{load}: {STEPS} publications, vLLM's log-probabilities follow the trainer's")


if __name__ == "__main__":
    sys.exit(main())
