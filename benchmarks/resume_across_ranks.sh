#!/bin/bash
# DCP checkpoints across learner sizes: a straight 2-rank run of 4 steps, and runs of 2 steps
# resumed to 4 on another number of ranks. Prints each run's last learner metrics.
cd "$(dirname "$0")/.."
# usage: benchmarks/resume_across_ranks.sh NEW_DIR (made here; an existing one is refused)
O=${1:-/tmp/resume_ranks}
if [ -e "$O" ] || [ -e "$O-cache" ]; then echo "$O or $O-cache exists: give a new directory" >&2; exit 2; fi
mkdir -p "$O"
S="--set model.tiny.hidden_size=32 --set model.tiny.num_layers=1 --set model.tiny.num_heads=2 --set model.tiny.intermediate_size=64 --set model.sft.skill_steps=20 --set model.sft.steps=10 --set model.sft.num_episodes=200 --set model.sft.batch_size=32 --set model.cache_dir=$O-cache --set trainer.lr=3e-3 --set rollout.tasks_per_step=4 --set rollout.group_size=4 --set rollout.max_turns=4 --set rollout.max_tokens_per_turn=24 --set trainer.eval_tasks=2 --set trainer.eval_every=0 --set trainer.checkpoint_every=1 --set logging.progress=false --set logging.tensorboard=false --set run.output_dir=$O"
T=".venv/bin/steprl train configs/calculator_tiny.yaml"
$T $S --set run.name=straight2 --set trainer.total_steps=4 --set runtime.learner_ranks=2 > $O/straight2.log 2>&1
$T $S --set run.name=r2to1 --set trainer.total_steps=2 --set runtime.learner_ranks=2 > $O/r2to1.log 2>&1
.venv/bin/steprl train --resume $O/r2to1 --set trainer.total_steps=4 --set runtime.learner_ranks=1 >> $O/r2to1.log 2>&1
$T $S --set run.name=r2to2 --set trainer.total_steps=2 --set runtime.learner_ranks=2 > $O/r2to2.log 2>&1
.venv/bin/steprl train --resume $O/r2to2 --set trainer.total_steps=4 --set runtime.learner_ranks=2 >> $O/r2to2.log 2>&1
$T $S --set run.name=r1to2 --set trainer.total_steps=2 --set runtime.learner_ranks=1 > $O/r1to2.log 2>&1
.venv/bin/steprl train --resume $O/r1to2 --set trainer.total_steps=4 --set runtime.learner_ranks=2 >> $O/r1to2.log 2>&1
.venv/bin/python - "$O" <<'PY'
import json
from safetensors.torch import load_file
import sys; O=sys.argv[1]
keys=("actor/pg_loss","actor/grad_norm","actor/entropy","actor/approx_kl","actor/clip_frac")
def rows(n): return [r for r in map(json.loads, open(f"{O}/{n}/metrics.jsonl")) if "actor/grad_norm" in r]
base=rows("straight2"); wb=load_file(f"{O}/straight2/checkpoints/latest/model.safetensors")
print("straight2 steps", len(base), "last", {k: base[-1][k] for k in keys})
for name in ("r2to2","r2to1","r1to2"):
    rr=rows(name)
    rel=max(abs(m[k]-b[k])/max(abs(b[k]),1e-9) for m,b in zip(rr,base,strict=True) for k in keys)
    same=all(m[k]==b[k] for m,b in zip(rr,base) for k in keys)
    w=load_file(f"{O}/{name}/checkpoints/latest/model.safetensors")
    wrel=max(float((w[k]-wb[k]).abs().max()/wb[k].abs().max()) for k in wb)
    print(name, "steps", len(rr), "metrics", "bit-identical" if same else f"max rel {rel:.2e}", "| weights", "bit-identical" if wrel==0 else f"max rel {wrel:.2e}")
PY
# 2 ranks -> 4 ranks: 4 one-CPU ranks need a Ray cluster that offers 4 CPUs (here: one head that
# claims 4 on 2 cores). `ray stop` ends every Ray process of this user: run nothing else on Ray.
if [ "${WITH_FOUR:-0}" = 1 ]; then
  $T $S --set run.name=r2to4 --set trainer.total_steps=2 --set runtime.learner_ranks=2 > $O/r2to4.log 2>&1
  export RAY_AUTH_MODE=token                       # a started cluster asks its clients for a token
  .venv/bin/ray get-auth-token --generate > $O/ray.log 2>&1
  .venv/bin/ray start --head --port=6393 --num-cpus=4 --include-dashboard=false >> $O/ray.log 2>&1
  RAY_ADDRESS=127.0.0.1:6393 .venv/bin/steprl train --resume $O/r2to4 --set trainer.total_steps=4 \
    --set runtime.learner_ranks=4 >> $O/r2to4.log 2>&1
  .venv/bin/ray stop >> $O/ray.log 2>&1
  .venv/bin/python - "$O" <<'PY'
import json, sys
O = sys.argv[1]
keys = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/approx_kl")
def rows(n): return [r for r in map(json.loads, open(f"{O}/{n}/metrics.jsonl")) if "actor/grad_norm" in r]
for name in ("straight2", "r2to4"):
    print(name, [{k: round(r[k], 6) for k in keys} | {"step": r.get("step")} for r in rows(name)])
PY
fi
