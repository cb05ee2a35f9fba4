#!/usr/bin/env bash
# stepskip inside verl: the rollouts of chosen steps are recorded on the first run and replayed on
# every later run of the same command, with no change to verl's code or config files.
#
# Needs verl's environment with stepskip installed into it (pip install -e /path/to/stepskip) and
# whatever verl's trainer needs (GPUs, an inference engine). Run it once to record, then again to
# replay; extra arguments are passed on to verl as Hydra overrides:
#
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct TRAIN_FILES=~/data/gsm8k/train.parquet VAL_FILES=~/data/gsm8k/test.parquet \
#       bash examples/verl_launcher.sh trainer.total_training_steps=100
#
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k/test.parquet}
DUMP_DIR=${DUMP_DIR:-$HOME/rollout_dump}

skip=(
    # The V1 trainer (verl's default) generates through the `rollout_tq` role; with
    # trainer.use_v1=False use the same keys under skip.rollout instead.
    skip.rollout_tq.enable=true
    # Where entries go: {dump_dir}/{experiment}_{project}/GBS{batch}_N{n}_in{prompt}_out{response}/{step}/.
    # Any fsspec URL works too (s3://bucket/prefix, with +skip.rollout_tq.storage_options=...).
    "skip.rollout_tq.dump_dir=$DUMP_DIR"
    # The steps to record and replay: ints and ranges ("a-b", "a-b:stride"), or "all".
    "skip.rollout_tq.steps=[1-50,100]"
    # cache: replay a recorded step, generate and record a missing one.
    skip.rollout_tq.action=cache
    # Keys verl's config does not declare need a "+": stop instead of replaying a step that was
    # recorded for other prompts (another data order or dataset).
    +skip.rollout_tq.check_prompts=error
)

verl=(
    # Your usual verl overrides; nothing here is specific to stepskip.
    algorithm.adv_estimator=grpo
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    data.train_batch_size=64
    data.max_prompt_length=512
    data.max_response_length=1024
    "actor_rollout_ref.model.path=$MODEL"
    actor_rollout_ref.rollout.n=8
    trainer.experiment_name=gsm8k_grpo
    trainer.project_name=stepskip_example
)

# The launcher: installs stepskip in this process and, through a Ray setup hook, in every worker
# verl starts, then runs verl.trainer.main_ppo exactly as `python -m verl.trainer.main_ppo` would.
command=(python -m stepskip.integrations.verl verl.trainer.main_ppo "${skip[@]}" "${verl[@]}" "$@")

if [ -n "${DRY_RUN:-}" ]; then
    printf '%q ' "${command[@]}"
    echo
else
    exec "${command[@]}"
fi
