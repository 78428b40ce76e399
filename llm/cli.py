"""`zerollm <command>`: the command line. It parses, then hands typed values to the library; a user mistake
prints one line and exits 2, no traceback.

Each command imports the modules it runs when it runs (torch and DeepSpeed take seconds to load), so
`zerollm --help` and light commands start at once; that is the only reason for imports inside functions here.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import io
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from launch.hostfile import MAX_SLOTS_PER_HOST
from launch.options import BACKENDS, DEFAULT_MASTER_PORT, HOSTFILE_LAUNCHERS, LaunchOptions, launcher_name
from llm import rundir
from llm.config import (
    LORA_SPEC_KEYS,
    RunConfig,
    build_config,
    check_new_run,
    load_recipe,
    parse_lora_spec,
    parse_override,
    recipe_names,
    refuse_set_twice,
)
from llm.errors import (
    EXIT_PIPE_CLOSED,
    EXIT_TERMINATED,
    EXIT_USER_ERROR,
    SigtermUnwinds,
    Terminated,
    UserError,
    not_utf8,
    report,
)
from llm.runtime.accelerator import check_chosen_accelerator, refuse_unknown_accelerator
from llm.stdout import SHOWN_ANYHOW, GuardedStdout, OutputLost, discard, on_terminal, settle
from llm.train.ds_config_file import load_ds_config
from llm.wording import for_terminal_stream, plural

EPILOG = "Documentation: README.md. Errors in your input exit with code 2."
INPUT_FORMATS = (".txt, .jsonl and .json files (each also compressed: .gz, .bz2, .xz, .zst), .parquet and .arrow "
                 "files, and folders written by datasets' save_to_disk (the tables and .zst need `pip install -e "
                 "'.[datasets]'` in zerollm's checkout)")
"""What `llm.data.readers` reads, for the help of every command that takes input files."""
LORA_HELP = ("train low-rank adapters on the frozen --init-from model instead of every weight, e.g. "
             "r=16,alpha=32,targets=wq,wk,wv,wo,w1,w2,w3,dropout=0.05 (the lora.* config keys; sft, dpo, grpo; "
             "see docs/lora.md)")


def a_path(text: str) -> str:
    """A path option's value: '' is refused (it was taken for the current directory: `--out ''` trained there,
    `--input ''` read all of it)."""
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a path (. for the current directory)")
    return text


class DeepSpeedConfigOption(argparse.Action):
    """--deepspeed FILE, or --deepspeed alone, DeepSpeed's switch in `deepspeed train.py --deepspeed
    --deepspeed_config ds.json` (its `add_config_arguments`): it asks for DeepSpeed, which zerollm always trains under,
    and leaves the file to --deepspeed_config (the stage's default without one). It took the next option for its file
    ('expected one argument'). Two files are refused: the last took the first's place without a word."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values is None:
            return
        given = getattr(namespace, self.dest)
        if given is not None and given != values:
            parser.error(f"{option_string}: a DeepSpeed config was given twice ({given} and {values}); give one")
        setattr(namespace, self.dest, values)


def whole_number(text: str) -> int:
    """An integer option's value, in ASCII decimal digits after an optional sign (int() alone also read '1_0000', '²'
    and ' 5': `--master-port 1_0000` ran on port 10000), or argparse's one line (its own for type=int named the
    function: 'invalid ranks_on_this_machine value')."""
    try:
        if re.fullmatch(r"[+-]?[0-9]+", text):
            return int(text)
    except ValueError:  # more digits than int() reads
        pass
    raise argparse.ArgumentTypeError(f"expects a whole number in decimal digits, got {text!r}")


def ranks_on_this_machine(text: str) -> int:
    """An --nproc value: 1..1024 ranks (0 and -1 ran one, -2 was a numpy traceback)."""
    value = whole_number(text)
    if not 1 <= value <= MAX_SLOTS_PER_HOST:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_SLOTS_PER_HOST}, got {value}")
    return value


def demo_steps(text: str) -> int:
    """The demo's pretraining steps: 2 or more (`demo --steps 0` ran the full demo, and with 1 its one evaluation
    could never show the validation loss falling: the demo reported failure after every stage ran)."""
    value = whole_number(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (the validation loss is compared between two "
                                         f"evaluations), got {value}")
    return value


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tsub = p.add_subparsers(dest="action", required=True)
    t = tsub.add_parser("train", help="train a tokenizer on text files", epilog=EPILOG,
                        description="Train byte-level BPE (exact round trip, ChatML special tokens at ids 0-3) "
                                    f"on text read streaming from {INPUT_FORMATS}; writes tokenizer.json and "
                                    "tokenizer_config.json, loadable by transformers.AutoTokenizer.")
    t.add_argument("--input", type=a_path, nargs="+", action="extend", required=True, metavar="PATH",
                   help="files or directories to read (a directory: every supported file under it; repeatable)")
    t.add_argument("--vocab-size", type=whole_number, required=True, help="vocabulary size including special tokens")
    t.add_argument("--out", type=a_path, required=True,
                   help="output directory: new, empty, or one this command wrote before "
                   "(its files are overwritten); any other folder is refused")
    t.add_argument("--min-frequency", type=whole_number, default=2, help="minimum pair frequency to merge (default 2)")


def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare tokenized HDF5 datasets")
    dsub = p.add_subparsers(dest="action", required=True)
    d = dsub.add_parser("prepare", help="tokenize files into HDF5", epilog=EPILOG,
                        description="Read .txt files (documents separated by blank lines), .jsonl and .json files "
                                    "({'text'} records, conversations, alpaca, preference pairs, ...), each also "
                                    "compressed (.gz, .bz2, .xz, .zst), and .parquet and .arrow files and folders "
                                    "written by datasets' save_to_disk (a row is a record; these and .zst need `pip "
                                    "install -e '.[datasets]'` in zerollm's checkout); tokenize them in parallel, "
                                    "append end-of-text after each document and write OUT/tokens.h5 with a train/val "
                                    "split and "
                                    "OUT/report.json. Malformed records are skipped and reported with file:line "
                                    "(file:row N in a table), or fatal with --strict.")
    d.add_argument("--kind", choices=["pretrain", "sft", "dpo"], default="pretrain",
                   help="pretrain: documents; sft: conversations with a loss mask on replies; dpo: preference pairs "
                        "(default pretrain)")
    d.add_argument("--input", type=a_path, nargs="+", action="extend", required=True, metavar="PATH",
                   help="files or directories to read (a directory: every supported file under it; repeatable)")
    d.add_argument("--tokenizer", type=a_path, required=True,
                   help="tokenizer directory (from `zerollm tokenizer train`)")
    d.add_argument("--out", type=a_path, required=True, help="output directory")
    d.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation (default 0.01)")
    d.add_argument("--workers", type=whole_number, default=None,
                   help="tokenizer processes, 1 to 4 x the CPU count (default: CPU count, at most 8)")
    d.add_argument("--strict", action="store_true", help="stop at the first malformed record instead of skipping it")
    d.add_argument("--seed", type=whole_number, default=0, help="seed of the train/val split (default 0)")
    d.add_argument("--seq-len", type=whole_number, default=512,
                   help="sft/dpo: longest sample in predicted positions; a longer conversation is cut after its "
                        "last reply that fits (skipped when even its first reply does not fit), a longer pair "
                        "truncated, each listed in the report (default 512)")
    d.add_argument("--max-record-mb", type=float, default=64.0,
                   help="largest JSON record read whole, in millions of characters; larger ones are skipped and "
                        "reported (.txt documents of any length are streamed in pieces; default 64)")


def _add_deepspeed_options(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--deepspeed", "--deepspeed_config", type=a_path, default=None, metavar="JSON",
                   action=DeepSpeedConfigOption,
                   help=f"DeepSpeed config: a JSON file, or a shipped one by name (pretrain_zero3, ...; default: "
                        f"{default}); 'auto' values come from the run config. --deepspeed_config is DeepSpeed's own "
                        "name for it, and --deepspeed alone (DeepSpeed's switch, as in --deepspeed "
                        "--deepspeed_config ds.json) is taken")
    p.add_argument("--zero-stage", type=whole_number, choices=[0, 1, 2, 3], default=None,
                   help="override zero_optimization.stage of the DeepSpeed config")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", type=a_path, required=True, help="packaged recipe name or YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a run-config key, e.g. --set train.lr=1e-3 (repeatable)")
    _add_deepspeed_options(p, "the stage's, ds_configs/<stage>.json")
    p.add_argument("--nproc", type=ranks_on_this_machine, default=1,
                   help="ranks on this machine, started by this command itself (default 1)")


STAGE_HELP = {
    "pretrain": ("pretrain on prepared data", "Pretrain a decoder under DeepSpeed ZeRO."),
    "sft": ("supervised fine-tuning on conversations",
            "Fine-tune on `data prepare --kind sft` conversations: loss on assistant replies only, several "
            "conversations packed per window without attending to each other. Start from --init-from."),
    "dpo": ("direct preference optimization on pairs",
            "Train on `data prepare --kind dpo` pairs against a frozen reference (a second DeepSpeed engine "
            "holding the --init-from weights); logs rewards/chosen, rewards/rejected, rewards/accuracy, "
            "rewards/margin."),
    "grpo": ("online group relative policy optimization on prompts and rewards",
             "Each step samples grpo.group_size completions per prompt from the current policy (our KV-cache "
             "generator), scores them with --reward, normalises rewards within each group and trains "
             "grpo.updates_per_batch clipped policy-ratio updates with a KL term to the frozen --init-from "
             "reference, over completion tokens only. Reads --prompts files directly (MiniMind RL conversations "
             "or {\"prompt\", \"answer\"} records; bad records are reported as file:line). Logs reward/mean, "
             "reward/std, reward/<term>, kl, clip_fraction, completion_length, rollout_tokens_per_sec. See "
             "docs/grpo.md."),
    "distill": ("distill a frozen teacher into a student on pretraining or SFT data",
                "Train the student the recipe (or --init-from) describes on `data prepare --kind pretrain` or "
                "`--kind sft` data against a frozen --teacher (a run or export directory with the data's tokenizer "
                "and the student's vocabulary size, any other shape): loss (1 - train.distill_alpha) * cross-entropy "
                "+ train.distill_alpha * T^2 * KL(teacher || student) at T = train.distill_temperature, per target "
                "that bears loss. Logs ce and distill_kl; val_loss is the student's cross-entropy. See "
                "docs/distill.md."),
}
REWARD_HELP = ("a reward term [WEIGHT*]NAME, repeatable: exact_match (final answer against the record's 'answer'), "
               "format[:REGEX], length (penalty), model:DIR (a local sequence-classification model) or "
               "module:function (yours); default: grpo.reward (exact_match)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model under DeepSpeed")
    tsub = p.add_subparsers(dest="stage", required=True)
    for stage, (short, long) in STAGE_HELP.items():
        t = tsub.add_parser(stage, help=short, epilog=f"Recipes: {', '.join(recipe_names())}. {EPILOG}",
                            description=long + " Writes RUN_DIR/config.yaml, RUN_DIR/ds_config.json, "
                            "RUN_DIR/metrics.jsonl and RUN_DIR/checkpoints/. SIGTERM saves a checkpoint and exits "
                            "75; --resume auto continues exactly, also on another number of ranks (GRPO: exactly on "
                            "the same number; its rollouts are sampled per rank). In a multi-rank "
                            "job a rank that dies or hangs ends the job on every rank, named, with exit 76.")
        _add_run_options(t)
        if stage == "grpo":
            t.add_argument("--prompts", type=a_path, nargs="+", action="extend", required=True, metavar="FILE",
                           help=f"prompt files or directories: {INPUT_FORMATS} (repeatable)")
            t.add_argument("--reward", action="append", default=None, metavar="TERM", help=REWARD_HELP)
        else:
            kinds = "pretrain` or `--kind sft" if stage == "distill" else stage
            t.add_argument("--data", type=a_path, required=True,
                           help=f"directory from `zerollm data prepare --kind {kinds}`")
        t.add_argument("--out", type=a_path, required=True, help="run directory")
        needed = (" (needed by dpo and grpo: the policy and the frozen reference start there; a --resume auto "
                  "takes the one the run records)") if stage in ("dpo", "grpo") else ""
        t.add_argument("--init-from", type=a_path, default=None, metavar="DIR",
                       help="start from the weights of a run directory or an export directory (ours, or a Llama, "
                            "Mistral, Qwen2/2.5 or Qwen3 saved by transformers); the run takes its model shape, RoPE "
                            f"and context length, the recipe the training settings{needed}")
        if stage == "distill":
            t.add_argument("--teacher", type=a_path, required=True, metavar="DIR",
                           help="the frozen teacher: a run directory (newest checkpoint) or an export directory")
        if stage == "dpo":
            t.add_argument("--beta", type=float, default=None, help="DPO beta (default: train.dpo_beta, 0.1)")
        # pretrain and distill keep --lora only to refuse it in one line that says where it belongs (llm.config)
        t.add_argument("--lora", default=None, metavar="SPEC",
                       help=LORA_HELP if stage in ("sft", "dpo", "grpo") else argparse.SUPPRESS)
        t.add_argument("--resume", choices=["auto", "never"], default="never",
                       help="auto: continue from the newest complete checkpoint in --out, if any")
        t.add_argument("--wandb", choices=["off", "offline", "online"], default=None,
                       help="log to wandb as well (default: the recipe's wandb.mode, off)")


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="start a training job on several nodes (hostfile, per node, SLURM)", allow_abbrev=False,
        usage="zerollm launch [options] -- train STAGE ...",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 done; 2 bad input or ranks that disagree; 75 stopped by SIGTERM/SIGINT with a "
               "checkpoint saved (rerun with --resume auto, on any number of ranks); 76 a rank died or hung "
               "(named in the message). " + EPILOG,
        description="Check a multi-node job, then start the real launcher.\n\n"
                    "  hostfile:  zerollm launch --hostfile hosts -- train pretrain ...\n"
                    "             (DeepSpeed's launcher reaches every host over pdsh/ssh or --launcher)\n"
                    "  per node:  zerollm launch --nnodes 2 --node-rank R --master-addr A -- train pretrain ...\n"
                    "             (run on every node; --backend torchrun uses c10d rendezvous)\n"
                    "  SLURM:     srun zerollm launch --backend slurm -- train pretrain ...\n"
                    "             (see launch/slurm/zerollm.sbatch)\n"
                    "  or, without zerollm launch: deepspeed [--hostfile H] --module llm train ...\n"
                    "                              torchrun --nproc-per-node N -m llm train ...\n\n"
                    "What crosses to other hosts (training arguments, --env values, .deepspeed_env lines) arrives "
                    "exactly as typed; what DeepSpeed's launcher cannot carry is refused. See docs/cluster.md.\n\n"
                    "Before starting: the hostfile, the training command, a free master port and (where ranks run on "
                    "this node) the data they read are checked. "
                    "Ranks compare code, config, data and tokenizer fingerprints at rendezvous, and a rank that "
                    "dies or hangs ends the job within train.collective_timeout_s.")
    p.add_argument("--hostfile", type=a_path, default=None, help="DeepSpeed hostfile: one 'HOST slots=N' per line")
    p.add_argument("--include", default="", metavar="HOSTS", help="hostfile hosts/slots to use, e.g. node1@node2:0,1")
    p.add_argument("--exclude", default="", metavar="HOSTS", help="hostfile hosts/slots to leave out")
    p.add_argument("--launcher", type=launcher_name, default="pdsh", metavar="{" + ",".join(HOSTFILE_LAUNCHERS) + "}",
                   help="how DeepSpeed reaches the hosts of a hostfile (default pdsh; the MPI launchers take the "
                        "ranks from the MPI environment; on SLURM use --backend slurm)")
    p.add_argument("--nnodes", type=whole_number, default=None, help="per-node mode: number of nodes")
    p.add_argument("--node-rank", type=whole_number, default=None, help="per-node mode: this node's rank, 0..nnodes-1")
    p.add_argument("--master-addr", default=None, help="address of node 0, reachable from every node")
    p.add_argument("--master-port", type=whole_number, default=DEFAULT_MASTER_PORT,
                   help=f"rendezvous port on node 0 (default {DEFAULT_MASTER_PORT})")
    p.add_argument("--nproc-per-node", type=whole_number, default=None,
                   help="ranks per node (default: the GPUs of the node, or 1 without GPUs; hostfile: its slots; "
                        "--backend slurm: SLURM_GPUS_ON_NODE, or 1 where SLURM gives none)")
    p.add_argument("--backend", choices=BACKENDS, default="deepspeed",
                   help="per-node launcher (default deepspeed); slurm = torchrun with the nodes taken from SLURM")
    p.add_argument("--rdzv-id", default=None, help="torchrun rendezvous id, the same on every node "
                                                   "(default: the SLURM job id, or 'zerollm')")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every rank's environment (repeatable; hostfile mode exports it to every host)")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- train STAGE ...", help="the training command")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on a built-in corpus, in minutes on a CPU", epilog=EPILOG,
                       description="Generate a small learnable corpus (facts and arithmetic in English and Chinese), "
                                   "train a tokenizer, prepare data, pretrain the 'demo' recipe under DeepSpeed "
                                   "(validation loss at each evaluation, greedy samples), then SFT on generated "
                                   "arithmetic questions, DPO preferring right answers over the SFT model's own wrong "
                                   "ones and GRPO with an exact-match reward, printing the accuracy on held-out "
                                   "questions after each stage. Exit code 1 if the pretraining validation loss did "
                                   "not fall.")
    p.add_argument("--out", type=a_path, default="runs/demo",
                   help="working directory: new, empty or an earlier demo's, whose files the demo replaces; any "
                        "other folder is refused (default runs/demo)")
    p.add_argument("--steps", type=demo_steps, default=None,
                   help="pretraining steps, and the most each later stage takes (default: the demo's own: 1000 "
                        "pretraining, 300 SFT, 100 DPO, 300 GRPO)")
    p.add_argument("--nproc", type=ranks_on_this_machine, default=1, help="ranks (default 1)")


DEVICE_CHOICES, DTYPE_CHOICES = ("auto", "cuda", "mps", "cpu"), ("auto", "fp32", "bf16", "fp16")
"""`llm.devices` holds their meaning; spelled here so that building the parser does not load torch."""


def _add_placement_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where the model runs (default auto: CUDA, else Apple MPS, else the CPU)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="precision (default auto: bf16 on GPUs that have it, fp16 on older GPUs and MPS, fp32 on CPU)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=a_path, required=True, help="run directory (newest checkpoint) or export directory")
    _add_placement_options(p)
    p.add_argument("--max-new-tokens", type=whole_number, default=None,
                   help="tokens to generate at most (default 128; generate: or what the model's context leaves after "
                        "the prompt, where that is fewer)")
    suggested = " (default: the model folder's generation_config.json, where it has one, else {})"
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; > 0 samples" + suggested.format("0"))
    p.add_argument("--top-k", type=whole_number, default=None,
                   help="sample among the k most likely tokens (0 = off)" + suggested.format("0"))
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold (1 = off)"
                   + suggested.format("1"))
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 1 discourages repeats"
                   + suggested.format("1"))
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--seed", type=whole_number, default=None, help="seed for reproducible sampling")


def _add_inference(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="continue a prompt", epilog=EPILOG,
                       description="Generate a continuation of --prompt (or a ChatML reply with --chat), streamed "
                                   "to stdout, using a KV cache.")
    _add_sampling_options(g)
    g.add_argument("--prompt", required=True, help="text to continue; - reads it from standard input (UTF-8, "
                                                   "without its final line end)")
    g.add_argument("--chat", action="store_true", help="treat the prompt as a user message and answer it (ChatML)")
    c = sub.add_parser("chat", help="multi-turn chat in the terminal", epilog=EPILOG,
                       description="A ChatML REPL with streamed replies. Commands: /reset, /system TEXT, /quit (or "
                                   "/exit).")
    _add_sampling_options(c)
    c.add_argument("--system", default=None, help="system prompt")
    e = sub.add_parser("export", help="export a run to Hugging Face Llama (or Qwen2, Qwen3, Mistral) format",
                       epilog=EPILOG,
                       description="Write model.safetensors, config.json (LlamaForCausalLM; Qwen3ForCausalLM for a "
                                   "model with QK-norm, Qwen2ForCausalLM for one with q, k and v biases, "
                                   "MistralForCausalLM for one whose hidden size is not a multiple of its heads) and "
                                   "the tokenizer files of a run's newest checkpoint (any ZeRO stage), or the one "
                                   "--tag names, to --out.")
    e.add_argument("--run", type=a_path, required=True, help="run directory")
    e.add_argument("--out", type=a_path, required=True, help="export directory")
    e.add_argument("--tag", default=None, help="the checkpoint to export: a folder in RUN/checkpoints, e.g. "
                                               "global_step200 (default: the newest complete one)")
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server", epilog=EPILOG,
                       description="Serve POST /v1/chat/completions (JSON or SSE stream), GET /v1/models and "
                                   "GET /health. Binds 127.0.0.1 unless --host says otherwise.")
    v.add_argument("--model", type=a_path, required=True, help="run directory or export directory")
    _add_placement_options(v)
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    v.add_argument("--port", type=whole_number, default=8000, help="port (default 8000; 0 picks a free one)")
    v.add_argument("--max-tokens", type=whole_number, default=256, help="default max_tokens of a request (default 256)")
    v.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in /v1/models and replies; a request naming another model gets 404 "
                        "(default: the --model folder's name)")
    v.add_argument("--api-key", default=os.environ.get("ZEROLLM_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $ZEROLLM_API_KEY); needed off loopback")
    v.add_argument("--max-connections-per-client", type=whole_number, default=None, metavar="N",
                   help="open connections one client address may hold, of the server's 64 (default 16, or 64 "
                        "on loopback); more get 429. Behind a reverse proxy every client has its address: give 64")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="loss, perplexity and bits per byte on text; benchmark suites through lm-eval", epilog=EPILOG,
        description="Score a model on text: --input FILE... (any format `data prepare` reads) or --data DIR "
                    "--split val (a prepared split). Prints loss per token, perplexity and bits per byte (total "
                    "nats / ln 2 / UTF-8 bytes of the scored text: tokenizer-independent). Or run benchmark suites "
                    "through lm-evaluation-harness: --tasks hellaswag,ceval-valid,cmmlu (needs `pip install "
                    "lm-eval 'transformers<5.25'`); the results table is printed and saved in MODEL/eval/.")
    p.add_argument("--model", type=a_path, required=True, help="run directory (newest checkpoint) or export directory")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--input", type=a_path, nargs="+", action="extend", metavar="PATH",
                      help="text files or directories to score (repeatable)")
    what.add_argument("--data", type=a_path, metavar="DIR",
                      help="prepared data directory (`zerollm data prepare --kind pretrain`)")
    what.add_argument("--tasks", metavar="LIST", help="comma-separated lm-eval tasks, e.g. hellaswag,ceval-valid,cmmlu")
    p.add_argument("--split", default=None, help="split of --data to score (default val)")
    p.add_argument("--context", type=whole_number, default=None,
                   help="tokens per window (default: the run's data.seq_len, or an export's max length up to 4096)")
    p.add_argument("--stride", type=whole_number, default=None,
                   help="tokens scored per window (default: the context; smaller gives each token more context)")
    p.add_argument("--batch-size", type=whole_number, default=8,
                   help="windows (or harness requests) per forward (default 8)")
    p.add_argument("--nproc", type=ranks_on_this_machine, default=1,
                   help="ranks on this machine for --input/--data (default 1)")
    p.add_argument("--json", action="store_true",
                   help="--input/--data: print one JSON object instead of the table (a perplexity beyond a float's "
                        "range is null)")
    _add_placement_options(p)
    p.add_argument("--limit", type=float, default=None,
                   help="--tasks: examples per task (a fraction if < 1), for a quick look")
    p.add_argument("--num-fewshot", type=whole_number, default=None,
                   help="--tasks: few-shot examples (default: the task's)")
    p.add_argument("--include-path", type=a_path, default=None, metavar="DIR",
                   help="--tasks: folder of your own task YAML files")
    p.add_argument("--out", type=a_path, default=None, metavar="DIR",
                   help="--tasks: where results go (default MODEL/eval)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="--tasks: give each question through the tokenizer's chat template, few-shot examples as "
                        "turns (for SFT, DPO and GRPO models; lm-eval's --apply_chat_template)")
    p.add_argument("--system-instruction", default=None, metavar="TEXT",
                   help="--tasks: a system turn before each question (with --apply-chat-template; else text before it)")
    p.add_argument("--log-samples", action="store_true",
                   help="--tasks: also save each request, the model's answer and its score, a jsonl file per task")


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw loss, validation loss, learning rate and throughput of runs", epilog=EPILOG,
                       description="Draw training loss, validation loss, learning rate and throughput against the "
                                   "step and against the tokens seen, several runs overlaid, from their "
                                   "metrics.jsonl (needs `pip install matplotlib`).")
    p.add_argument("runs", type=a_path, nargs="+", metavar="RUN", help="run directories")
    p.add_argument("--out", type=a_path, required=True, metavar="FILE",
                   help="picture to write (.png; .pdf and .svg work too)")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="what", required=True)
    b = bsub.add_parser("train", help="training throughput of a recipe on random tokens", epilog=EPILOG,
                        description="Run a short training job on random tokens and print trainable parameters, "
                                    "tokens/s, s/step, loss-bearing tokens/s, MFU and peak memory (warm-up steps "
                                    "excluded); with --lora, full fine-tuning and LoRA side by side.")
    _add_run_options(b)
    b.add_argument("--steps", type=whole_number, default=10, help="measured steps (default 10)")
    b.add_argument("--warmup", type=whole_number, default=2, help="steps excluded from the figures (default 2)")
    b.add_argument("--lora", default=None, metavar="SPEC",
                   help="fine-tune a random model of the recipe on random conversations (SFT) with every parameter "
                        "and with LoRA SPEC (e.g. r=16,alpha=32), and print both side by side: trainable "
                        "parameters, tokens/s, s/step, MFU, peak memory")
    learn = bsub.add_parser(
        "learn", help="how much a recipe learns in a fixed wall time, on your text", epilog=EPILOG,
        description="Inside --budget, timed from the start: split the file (first 90 % for training, the rest "
                    "held out), train a tokenizer, prepare the data, train the recipe with train.max_time set to the "
                    "time left (less --reserve), and print bits per byte on the held-out part. Exits 1 if the whole "
                    "took longer than the budget.")
    learn.add_argument("--input", type=a_path, required=True, metavar="FILE",
                       help="a .txt or .jsonl file (e.g. a novel)")
    learn.add_argument("--budget", default="10m", help="wall time for everything, e.g. 10m, 600, 1h (default 10m)")
    learn.add_argument("--recipe", type=a_path, default="cpu-10m",
                       help="packaged recipe name or YAML file (default cpu-10m)")
    learn.add_argument("--vocab-size", type=whole_number, default=None, help="tokenizer size (default: the recipe's)")
    learn.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a run-config key (repeatable)")
    learn.add_argument("--reserve", type=float, default=15.0,
                       help="seconds kept for starting the training job and the final evaluation (default 15)")
    _add_deepspeed_options(learn, "ds_configs/pretrain.json")
    learn.add_argument("--out", type=a_path, default="runs/learn", help="working directory (default runs/learn)")
    g = bsub.add_parser("generate", help="prefill and decode speed: cached, uncached, transformers", epilog=EPILOG,
                        description="Time prefill and decode tokens/s of greedy generation with our KV cache, "
                                    "without it (whole sequence recomputed per token), and with transformers' "
                                    "generate on the exported weights, side by side.")
    g.add_argument("--model", type=a_path, required=True, help="run directory or export directory")
    _add_placement_options(g)
    g.add_argument("--prompt-tokens", type=whole_number, default=128, help="prompt length (default 128)")
    g.add_argument("--new-tokens", type=whole_number, default=64, help="tokens to decode (default 64)")
    g.add_argument("--batch", type=whole_number, default=1, help="prompts per batch (default 1)")
    g.add_argument("--repeats", type=whole_number, default=3,
                   help="runs per variant; the median is reported (default 3)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerollm", epilog=EPILOG,
                                     description="Train decoder-only language models end to end under DeepSpeed ZeRO.")
    # DeepSpeed's per-node launcher (unless --no_local_rank) and torch.distributed.launch put this before the
    # command: `python -m llm --local_rank=0 train ...`; the same number is in LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=whole_number, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_tokenizer(sub)
    _add_data(sub)
    _add_train(sub)
    _add_launch(sub)
    _add_inference(sub)
    _add_demo(sub)
    _add_bench(sub)
    _add_eval(sub)
    _add_plot(sub)
    return parser


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from llm.data.formats import PretrainTexts, expand_inputs
    from llm.tokenizer import train_tokenizer

    # a tokenizer written into an input folder is not read back
    texts = PretrainTexts(expand_inputs(args.input, exclude=args.out, note_links_out=True))
    tok = train_tokenizer(texts, args.vocab_size, Path(args.out), args.min_frequency, unusable=texts.skipped_note)
    skipped = texts.skipped_count
    print(f"tokenizer: {tok.vocab_size} tokens, hash {tok.hash}, written to {args.out}"
          + (f" ({skipped} unusable {plural('record', skipped)} skipped)" if skipped else ""))
    if tok.vocab_size < args.vocab_size:
        print(f"note: {tok.vocab_size} tokens, not the {args.vocab_size} asked for: the text has no more pairs "
              f"seen at least {args.min_frequency} times (--min-frequency) to merge")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from llm.data.prepare import prepare
    from llm.tokenizer import Tokenizer

    for note in Tokenizer.load(args.tokenizer).notes:  # e.g. no pad token: padding with end of text
        print(f"note: {note}")
    report = prepare(args.kind, args.input, args.tokenizer, args.out, val_fraction=args.val_fraction,
                     workers=args.workers, strict=args.strict, seed=args.seed, seq_len=args.seq_len,
                     max_record_mb=args.max_record_mb)
    print(report.summary())
    print(f"written to {args.out}")
    return 0


def _train_config(args: argparse.Namespace):
    """The run config of a `train STAGE` command: recipe, --set overrides, then the command's own options."""
    extra = [f"train.stage={args.stage}"] + ([f"wandb.mode={args.wandb}"] if args.wandb else [])
    if getattr(args, "beta", None) is not None:
        extra.append(f"train.dpo_beta={args.beta}")
    if args.lora is not None:
        extra += parse_lora_spec(args.lora)
    options = {"train.stage": f"`train {args.stage}`", "wandb.mode": "--wandb", "train.dpo_beta": "--beta",
               **{f"lora.{key}": "--lora" for key in LORA_SPEC_KEYS},
               **PATH_OPTIONS}
    given = {parse_override(o)[0] for o in extra} | {key for key, value in _path_options(args).items() if value}
    refuse_set_twice(args.overrides, {key: options[key] for key in given})
    recipe = load_recipe(args.recipe)
    train = recipe.get("train")
    init_from = args.init_from or next((value for key, value, _ in map(parse_override, args.overrides)
                                        if key == "train.init_from"), train.get("init_from") if isinstance(train, dict)
                                       else None)
    paths = _path_options(args)
    if init_from or args.resume == "auto":  # torch only then: a mistake in a new run's paths is said before it loads
        from llm.loading import base_to_resume_on, recipe_for_init_from

        if not init_from and args.resume == "auto":  # resumed without --init-from: the base the run records
            paths["train.init_from"] = base_to_resume_on(Path(args.out))
        recipe = recipe_for_init_from(recipe, init_from, Path(args.out) if args.resume == "auto" else None,
                                      "--init-from" if args.init_from else "train.init_from")
    cfg = build_config(recipe, [*args.overrides, *extra], paths=paths)
    check_new_run(cfg)
    return cfg


PATH_OPTIONS = {"data.path": "--data", "train.init_from": "--init-from", "train.teacher": "--teacher",
                "grpo.prompts": "--prompts", "grpo.reward": "--reward"}
"""The run-config keys that a `train STAGE` command's options give, taken as written (`build_config`'s paths)."""


def _path_options(args: argparse.Namespace) -> dict[str, str | list[str] | None]:
    return {key: getattr(args, option.removeprefix("--").replace("-", "_"), None) for key, option in
            PATH_OPTIONS.items()}


def _checked_before_ranks(args: argparse.Namespace):
    """The run config of a `train STAGE` command, after what is checked before any rank starts: its output folder
    and its DeepSpeed JSON's file (its values are checked in every rank)."""
    from launch.local import under_launcher

    cfg = _train_config(args)
    rundir.check_run_output(Path(args.out), args.resume == "auto")
    load_ds_config(args.deepspeed, cfg.train.stage)
    if cfg.train.init_from:  # its generation_config.json, which the run keeps a copy of, is usable (torch is
        from llm.infer.suggested_sampling import suggested_sampling  # loaded for --init-from already)

        suggested_sampling(cfg.train.init_from)
    if not under_launcher():  # said once, by the process that starts the ranks
        _note_dormant_keys(args.overrides, cfg)
    return cfg


MOE_KEYS = ("model.n_experts", "model.n_experts_per_token", "model.n_shared_experts", "model.moe_aux_loss_coef",
            "model.norm_topk_prob")
DORMANT_KEYS = (
    (lambda key: key.startswith("lora.") and key != "lora.r", lambda cfg: not cfg.lora.r,
     "lora.r is 0: no LoRA, every weight trains (--set lora.r=N or --lora r=N for adapters)"),
    (lambda key: key == "train.teacher" or key.startswith("train.distill_"), lambda cfg: cfg.train.stage != "distill",
     "only `train distill` reads them: no teacher, nothing distilled"),
    (lambda key: key.startswith("train.dpo_"), lambda cfg: cfg.train.stage != "dpo", "only `train dpo` reads them"),
    (lambda key: key.startswith("grpo."), lambda cfg: cfg.train.stage != "grpo", "only `train grpo` reads them"),
    (lambda key: key in MOE_KEYS, lambda cfg: not cfg.model.moe,
     "model.moe is false: a dense model, no experts (--set model.moe=true for a mixture of experts)"),
    (lambda key: key in ("model.rope_factor", "model.rope_original_max_seq_len"),
     lambda cfg: cfg.model.rope_scaling == "none",
     "model.rope_scaling is 'none': RoPE is not scaled (--set model.rope_scaling=yarn or llama3 to extend it)"),
    (lambda key: key.startswith("model.yarn_"), lambda cfg: cfg.model.rope_scaling != "yarn",
     "only model.rope_scaling=yarn reads them"),
    (lambda key: key.startswith("model.llama3_"), lambda cfg: cfg.model.rope_scaling != "llama3",
     "only model.rope_scaling=llama3 reads them"),
)
"""(which `--set` keys, when they are read by nothing, why) for keys a run keeps in its config but does not use."""


def _note_dormant_keys(overrides: list[str], cfg: RunConfig) -> None:
    """`--set` keys this run reads nothing of (`--set lora.alpha=64` without lora.r trains every weight, as without
    LoRA; `--set train.teacher=T` in `train sft` trains without a teacher): said, not refused (a recipe may keep a
    section that is off)."""
    keys = [key for key, _, _ in map(parse_override, overrides)]
    for named, dormant, why in DORMANT_KEYS:
        if (unread := [key for key in keys if named(key)]) and dormant(cfg):
            print(f"zerollm: note: {', '.join(unread)} set, but {why}", file=sys.stderr, flush=True)


def _check_rank_inputs(cfg: RunConfig, starting_ranks: bool) -> None:
    """What the ranks of a training job read, checked by the process about to start them (`starting_ranks`), so
    that a mistake is one line before any rank starts, not one per rank: the prepared data (a wrong --data: one line
    before torch loads, in a one-process job too); GRPO's prompts and rewards and a teacher that does not fit only
    where ranks are started (a one-process job checks them as it starts)."""
    if cfg.train.stage != "grpo":  # GRPO reads prompt files, not prepared data
        from llm.data.prepared import stage_data_attrs

        attrs = stage_data_attrs(cfg.train.stage, cfg.data.path)
    if starting_ranks and cfg.train.stage == "grpo":
        from llm.train.rollout import grpo_inputs

        grpo_inputs(cfg)
    if starting_ranks and cfg.train.stage == "distill":
        from llm.train.teacher import check_teacher

        check_teacher(cfg, attrs)


def cmd_train(args: argparse.Namespace) -> int:
    from launch.local import relaunch_local, starts_ranks

    starting_ranks = starts_ranks(args.nproc)  # this process starts the ranks and waits
    cfg = _checked_before_ranks(args)
    check_chosen_accelerator()  # the ranks train here (`zerollm launch` may start them on other machines)
    _check_rank_inputs(cfg, starting_ranks)
    if starting_ranks:
        return relaunch_local(args.nproc, args.argv)
    from llm.train.job import run

    end_rank(lambda: run(cfg, Path(args.out), args.deepspeed, resume=args.resume == "auto",
                         zero_stage=args.zero_stage))


def _launch_only_options(parser: argparse.ArgumentParser) -> set[str]:
    """The options of `zerollm launch` that `zerollm train` does not take, of `parser` (`build_parser`'s)."""
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    train = next(a for a in commands.choices["train"]._actions if isinstance(a, argparse._SubParsersAction))
    return set(commands.choices["launch"]._option_string_actions) - \
        set().union(*(stage._option_string_actions for stage in train.choices.values()))


def checked_training_command(job: list[str]) -> tuple[list[str], Path, RunConfig]:
    """The command after `zerollm launch ... --` (it must be `train ...`), parsed and its config built here, so a
    mistake fails before any rank starts; returns (the command, its run directory, its run config)."""
    job = job[1:] if job[:1] == ["--"] else job
    if job[:1] != ["train"]:
        said = f"`{job[0]}` is not a training command: " if job else ""
        raise UserError(f"{said}give the training command after '--', e.g. "
                        "zerollm launch ... -- train pretrain --recipe demo --data DATA --out RUN")
    if any(arg == "--nproc" or arg.startswith("--nproc=") for arg in job):
        raise UserError("--nproc belongs to single-machine runs; under `zerollm launch` use --nproc-per-node")
    parser = build_parser()
    launch_only = _launch_only_options(parser)
    launch_options_given = [arg for arg in job if arg.partition("=")[0] in launch_only]
    if launch_options_given:  # the training command's parser refused them, printing the usage of `zerollm`
        raise UserError(f"{launch_options_given[0]} is an option of `zerollm launch`: give launch options before "
                        "'--' and the training command after it (zerollm launch --hostfile FILE -- train ...)")
    try:
        parsed = parser.parse_args(job)
    except SystemExit as exc:
        raise UserError(f"the training command is invalid: {' '.join(job)}") from exc
    _refuse_paths_libraries_cannot_open(parsed)  # here, not once in every rank
    return job, Path(parsed.out), _checked_before_ranks(parsed)


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(hostfile=args.hostfile, include=args.include, exclude=args.exclude, launcher=args.launcher,
                         nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                         master_port=args.master_port, nproc_per_node=args.nproc_per_node, backend=args.backend,
                         rdzv_id=args.rdzv_id, env=args.env)


def cmd_launch(args: argparse.Namespace) -> int:
    from launch.launcher import launch

    job, run_dir, cfg = checked_training_command(args.job)
    return launch(launch_options(args), job, run_dir, lambda: _check_rank_inputs(cfg, starting_ranks=True))


def _sampling(args: argparse.Namespace):
    from llm.infer.sampling import InvalidSampling, SamplingParams
    from llm.infer.suggested_sampling import suggested_note, suggested_sampling

    options = {key: getattr(args, key) for key in ("max_new_tokens", "temperature", "top_k", "top_p",
                                                   "repetition_penalty")}
    given = {key: value for key, value in options.items() if value is not None}  # the others take their defaults
    try:
        params = SamplingParams(**given, stop=args.stop, seed=args.seed)
    except InvalidSampling as exc:  # named by its option
        raise UserError(f"--{exc.field.replace('_', '-')} {exc.reason}") from None
    suggested = suggested_sampling(args.model)
    for key, value in suggested.items():
        if key not in given:
            setattr(params, key, value)
    if note := suggested_note(args.model, suggested, set(given)):
        print(f"zerollm: {note}", file=sys.stderr, flush=True)
    return params


def _generator(args: argparse.Namespace):
    from llm.devices import place, resolve
    from llm.infer.generate import TextGenerator
    from llm.loading import load_for_inference

    device, dtype = resolve(args.device, args.dtype)
    model, tokenizer = load_for_inference(args.model)
    return TextGenerator(place(model, device, dtype), tokenizer)


def _prompt_text(option: str) -> str:
    """The text of `--prompt`: as given, or for '-' what standard input holds, less one final line end (what a
    pipe or `<<<` adds)."""
    if option != "-":
        return option
    data = sys.stdin.buffer.read() if sys.stdin is not None else b""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompt -: standard input is not UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                        f"{exc.start})") from None
    return text.removesuffix("\n").removesuffix("\r")


def cmd_generate(args: argparse.Namespace) -> int:
    params, text = _sampling(args), _prompt_text(args.prompt)
    generator = _generator(args)
    try:
        prompt = (generator.tokenizer.encode_chat([{"role": "user", "content": text}],
                                                  add_generation_prompt=True) if args.chat else
                  generator.prompt_ids(text))
    except ValueError as exc:  # text that is not UTF-8
        raise UserError(f"--prompt: {exc}") from None
    left = generator.model.cfg.max_seq_len - len(prompt)
    if args.max_new_tokens is None and 0 < left < params.max_new_tokens:  # a default, not the user's: what fits
        params.max_new_tokens = left
    if (problem := generator.room_problem(len(prompt), params.max_new_tokens, "--max-new-tokens")) is not None:
        fits_alone = len(prompt) < generator.model.cfg.max_seq_len
        raise UserError(f"{problem}: "
                        f"{'lower --max-new-tokens or ' if fits_alone else ''}shorten the prompt")

    stream = generator.stream(prompt, params)
    for piece in for_terminal_stream(stream) if on_terminal() else stream:
        print(piece, end="", flush=True)
    print(flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from llm.infer.chat import ChatSession, chat_repl

    params = _sampling(args)  # a model folder's unusable generation_config.json is said before the model loads
    generator = _generator(args)
    if args.max_new_tokens is None:  # a default, not the user's: half the context at most, the rest for the chat
        params.max_new_tokens = min(params.max_new_tokens, max(1, generator.model.cfg.max_seq_len // 2))
    try:
        session = ChatSession(generator, params, system=args.system)
    except ValueError as exc:  # the text is not valid Unicode
        raise UserError(f"--system: {exc}") from None
    if sys.stdin is None:  # started with its input closed (<&-): an input that has ended, as </dev/null
        sys.stdin = io.StringIO()
    if isinstance(sys.stdin, io.TextIOWrapper):  # a line that is not UTF-8 is refused, not a crash losing the chat
        sys.stdin.reconfigure(errors="surrogateescape")
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401, PLC0415 - input() then edits the line (arrows, history), as in a shell

    chat_repl(session, interactive=interactive)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llm.export import export_model, refuse_replacing_a_source
    from llm.loading import load_trained_model, lora_bases, run_tokenizer

    if args.tag is not None and rundir.is_run_dir(Path(args.run)) and \
            args.tag not in (tags := rundir.checkpoint_tags(Path(args.run))):  # (not a run: the loading says so)
        raise UserError(f"--tag {args.tag}: {args.run} holds no such checkpoint (it holds "
                        f"{', '.join(tags) if tags else 'none'})")
    model, cfg = load_trained_model(Path(args.run), args.tag)
    refuse_replacing_a_source(Path(args.out), cfg, lora_bases(cfg))
    # a damaged copy is refused, naming it, before anything is written
    kept = run_tokenizer(Path(args.run)) is not None
    architecture = export_model(model, rundir.tokenizer_dir(Path(args.run)), Path(args.out),
                                Path(args.run) / rundir.GENERATION_CONFIG_FILE)
    of = f" of {args.tag}" if args.tag else ""
    print(f"exported {model.num_parameters():,} parameters{of} to {args.out} ({architecture}, safetensors)")
    if not kept:  # the copy was deleted, or the run trained on random tokens (`bench train`)
        print(f"zerollm: note: {args.run} keeps no tokenizer ({rundir.tokenizer_dir(Path(args.run))} is missing), so "
              f"the export has none: copy the tokenizer files it was trained with into {args.out} before generate, "
              "chat, serve or eval use it", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from llm.infer.server import ChatService, bind_server, check_default_max_tokens, served_name
    from llm.infer.suggested_sampling import suggested_note, suggested_sampling

    check_default_max_tokens(args.max_tokens)  # the options, then the address (bind_server), before the model loads
    suggested = suggested_sampling(args.model)
    name = served_name(args.served_model_name, args.model)
    server = bind_server(args.host, args.port, api_key=args.api_key,
                         max_connections_per_client=args.max_connections_per_client)

    terminated = False
    try:
        with SigtermUnwinds():  # raised where serve_forever waits, as Ctrl-C's KeyboardInterrupt is
            server.service = ChatService(_generator(args), name, args.max_tokens, suggested=suggested)
            if note := suggested_note(args.model, suggested, overridden=set(), overrider="a request's field"):
                print(f"zerollm: {note}", flush=True)
            print(f"serving {server.service.model_name} on {server.url}/v1 (Ctrl-C stops)", flush=True)
            server.serve_forever()  # until Ctrl-C (exit 130) or SIGTERM (143)
    except Terminated:
        terminated = True
    finally:  # the reply being generated ends with an error and the waiting requests get a 503, on SIGTERM too (the
        server.server_close()  # process ended at once: a stream cut off, which clients read as a finished reply)
        if server.service is not None:
            server.service.close()
    if terminated:  # then ended by the signal, as a service manager expects of SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        return EXIT_TERMINATED
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from llm.demo import run_demo

    return run_demo(Path(args.out), steps=args.steps, nproc=args.nproc)


def _refuse_given(options: tuple[tuple[str, object], ...], applies_to: str) -> None:
    """Refuse the options given (a value other than None) that do not apply, in one line: they apply to
    `applies_to`."""
    given = [option for option, value in options if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to {applies_to}")


def cmd_eval(args: argparse.Namespace) -> int:
    from llm.eval.perplexity import check_batch_size, check_rank_device, check_sources, run_perplexity

    check_batch_size(args.batch_size)  # lm-eval failed on it after loading everything; ranks each refused it
    if args.tasks is not None:
        from llm.eval.harness import parse_tasks, run_tasks

        _refuse_given((("--nproc", args.nproc > 1 or None), ("--stride", args.stride), ("--split", args.split),
                       ("--json", args.json or None)),
                      "--input/--data; --tasks runs in one process, prints the harness's table and saves its "
                      "results (the .json in MODEL/eval, or --out)")
        if args.system_instruction is not None and (found := not_utf8(args.system_instruction)):
            raise UserError(f"--system-instruction: not UTF-8 text ({found[1]} at character {found[0]})")
        run_tasks(args.model, parse_tasks(args.tasks), limit=args.limit, num_fewshot=args.num_fewshot,
                  include_path=args.include_path, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                  out_dir=args.out, context=args.context, chat=args.apply_chat_template,
                  system_instruction=args.system_instruction, log_samples=args.log_samples)
        return 0
    from launch.local import relaunch_local, starts_ranks, under_launcher

    _refuse_given((("--limit", args.limit), ("--num-fewshot", args.num_fewshot), ("--include-path", args.include_path),
                   ("--out", args.out), ("--apply-chat-template", args.apply_chat_template or None),
                   ("--system-instruction", args.system_instruction), ("--log-samples", args.log_samples or None)),
                  "--tasks; --input and --data print their result")
    if args.split is not None and args.data is None:
        raise UserError("--split applies to --data (a prepared split); --input scores every document of its files")
    if starts_ranks(args.nproc):
        import torch

        from llm.devices import mps_available, resolve
        from llm.runtime.accelerator import training_device_type

        resolve(args.device, args.dtype)  # a device that is not here
        check_sources(args.model, args.input, args.data, args.split)  # once here, not once a rank
        check_rank_device(args.device, training_device_type(torch.cuda.is_available(), mps_available(), args.nproc),
                          args.nproc)
        return relaunch_local(args.nproc, args.argv, advice="rerun the command (nothing was saved)")

    def score() -> int:
        return run_perplexity(args.model, args.input, args.data, args.split, context=args.context,
                              stride=args.stride, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                              as_json=args.json)

    if under_launcher():  # a rank of a job, its gloo group open
        end_rank(score)
    return score()


def cmd_plot(args: argparse.Namespace) -> int:
    from llm.plot import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from llm.bench import bench_generate, bench_train

    if args.what == "learn":
        from llm.eval.learning_speed import bench_learn

        code = bench_learn(args.input, args.out, recipe=args.recipe, budget=args.budget, reserve=args.reserve,
                           vocab_size=args.vocab_size, overrides=args.overrides, deepspeed_config=args.deepspeed,
                           zero_stage=args.zero_stage)
        end_now(code)  # the training job ran in this process: end it without teardown, as end_rank does
    with SigtermUnwinds():  # their temporary folders are removed on SIGTERM too
        if args.what == "train":
            return bench_train(args.recipe, args.overrides, steps=args.steps, warmup=args.warmup, nproc=args.nproc,
                               deepspeed_config=args.deepspeed, zero_stage=args.zero_stage, lora=args.lora)
        return bench_generate(args.model, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              batch=args.batch, repeats=args.repeats, device=args.device, dtype=args.dtype)


COMMANDS = {"tokenizer": cmd_tokenizer, "data": cmd_data, "train": cmd_train, "launch": cmd_launch,
            "generate": cmd_generate,
            "chat": cmd_chat, "export": cmd_export, "serve": cmd_serve, "demo": cmd_demo, "bench": cmd_bench,
            "eval": cmd_eval, "plot": cmd_plot}


UNUSABLE_PATH = (errno.ENAMETOOLONG, errno.EACCES, errno.EPERM)
"""Errors of a path the user gave that the file system refuses (a name over 255 bytes, a folder closed to this user):
one line naming it, where they reach `main`."""


def _given(filename: str | bytes | int | None, argv: list[str]) -> bool:
    """Whether `filename` (an OSError's) is one of the command line's paths or lies under one."""
    if not isinstance(filename, str | bytes):
        return False
    name = os.fsdecode(filename)
    return any(name == arg or name.startswith(arg.rstrip("/") + "/") for arg in argv if arg)


def end_now(code: int) -> NoReturn:
    """End this process with `code` once what it printed is flushed and its temporary folders are removed, without
    the rest of interpreter teardown (finalizers, atexit handlers, freeing objects), where that teardown can
    crash."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, OutputLost, AttributeError):  # AttributeError: None, a closed descriptor
            stream.flush()
    remove_temporary_folders()
    os._exit(code)


def remove_temporary_folders() -> None:
    """Remove the folders of every `tempfile.TemporaryDirectory` still open, as their finalizers do at interpreter
    teardown, in a process that imported wandb: it makes two as it is imported (for media and artifacts), and every
    run logged to it left both in the temporary folder. One that cannot be removed is left. (The search looks at
    every object, 0.1-0.2 s in a training rank: only where wandb is there to have made them.)"""
    if "wandb" not in sys.modules:
        return
    # type(), not isinstance: that reads __class__, which warns on some objects (torch.distributed.reduce_op)
    for folder in [obj for obj in gc.get_objects() if issubclass(type(obj), tempfile.TemporaryDirectory)]:
        if getattr(folder, "_delete", True):  # Python 3.12's delete=False: kept at teardown too
            with contextlib.suppress(OSError):
                folder.cleanup()


def end_rank(job: Callable[[], int]) -> NoReturn:
    """Run the job of a rank (or of a one-process `zerollm train`) and end its process with the job's exit code, or
    EXIT_USER_ERROR once a UserError it raised is printed (e.g. a refusal every rank raised, its gloo group still
    open). Every file is written and every rank has passed the job's last collective by then, so the process ends
    without interpreter teardown: destroying ZeRO-3 engines and gloo groups there, or a watchdog's heartbeat caught
    mid-call, can abort ("terminate called without an active exception": exit 76, a rank lost, not 2)."""
    try:
        code = job()
        if sys.stdout is not None:
            sys.stdout.flush()  # as main does: a failure of what is still buffered is said, not lost with the process
    except UserError as exc:
        _report(exc)
        code = EXIT_USER_ERROR
    end_now(code)


def _report(exc: UserError) -> None:
    if exc.announce:  # one every rank raises was printed once per node as it was raised
        report(str(exc))


NEGATIVE_WEIGHT = re.compile(r"-\.?\d")
"""The start of a --reward term with a negative weight (-1*length, -.5*format)."""


def attach_negative_weights(argv: list[str]) -> list[str]:
    """`--reward -1*length` as `--reward=-1*length`: argparse takes a separate value that starts with '-' for an
    option and stops ('expected one argument')."""
    attached = []
    for arg in argv:
        if attached and attached[-1] == "--reward" and NEGATIVE_WEIGHT.match(arg):
            attached[-1] = f"--reward={arg}"
        else:
            attached.append(arg)
    return attached


DEEPSPEED_LAUNCHER_OPTIONS = frozenset({"--hostfile", "--num_gpus", "--num_nodes", "--include", "--exclude",
                                        "--master_port", "--master_addr", "--launcher", "--no_ssh"})
"""Options of DeepSpeed's `deepspeed` launcher, which users give to the command they would have launched with it."""


LAUNCH_SPELLINGS = {"--master_port": "--master-port", "--master_addr": "--master-addr", "--node_rank": "--node-rank",
                    "--nproc_per_node": "--nproc-per-node", "--num_gpus": "--nproc-per-node", "--rdzv_id": "--rdzv-id",
                    "--rdzv-endpoint": "--master-addr and --master-port",
                    "--num_nodes": "--nnodes (per-node mode; with a hostfile, choose its nodes with --include or "
                                   "--exclude)"}
"""DeepSpeed's and torchrun's spellings of `zerollm launch` options."""


MODEL_FOLDER_OPTIONS = ("model", "run", "init_from", "teacher")
"""The options naming a run or export, whose files torch and safetensors open (checkpoints, weights): their C++ and
Rust take UTF-8 paths only."""
MODEL_FOLDER_KEYS = ("train.init_from",)
"""The run-config keys that name such a folder where no option does (`train distill` requires `--teacher`)."""
WITHOUT_DEEPSPEED = ("tokenizer", "data", "plot")
"""The commands that never import DeepSpeed: a DS_ACCELERATOR it does not know is theirs to ignore."""
GLOB_MAGIC = re.compile(r"[*?[]")
"""What glob reads as a pattern: DeepSpeed finds checkpoint files with glob below the run's path."""
MODEL_WRITING_COMMANDS = ("train", "export", "demo", "bench")
"""The commands whose --out is (or holds) a run or an export (bench: bench learn's)."""


def _refuse_paths_libraries_cannot_open(args: argparse.Namespace) -> None:
    """A run or export folder whose name is not UTF-8 (GBK bytes from a zip made on Windows) was written, then could
    not be read: its checkpoints were called damaged ('train the run again'), its weights unreadable. Data, tokenizer,
    plot and evaluation folders are read and written by Python, h5py and zerollm itself: any name. A run's path
    holding glob's `*`, `?` or `[` is refused too (`run[1]` loaded the checkpoints of `run1`)."""
    dests = (*MODEL_FOLDER_OPTIONS, *(["out"] if args.command in MODEL_WRITING_COMMANDS else []))
    given = [(f"--{dest.replace('_', '-')} ", getattr(args, dest, None)) for dest in dests]
    given += [(f"--set {key}=", raw) for key, _, raw in map(parse_override, getattr(args, "overrides", None) or [])
              if key in MODEL_FOLDER_KEYS]  # a recipe file is UTF-8: only a --set can name such a folder
    for option, value in given:
        if isinstance(value, str | os.PathLike) and (found := not_utf8(str(value))):
            raise UserError(f"{option}{value}: its name holds {found[1]}, which is not UTF-8; torch and safetensors "
                            "open no file below such a name: rename it")
        runs = option.startswith("--out") and args.command != "export" or rundir.is_run_dir(Path(value)) \
            if isinstance(value, str | os.PathLike) else False
        if runs and (magic := GLOB_MAGIC.search(os.path.abspath(value))):
            raise UserError(f"{option}{value}: its path holds '{magic.group()}', which DeepSpeed reads as a pattern "
                            "where it looks for a run's checkpoint files (another folder's were loaded, or none "
                            "found): rename it")


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; an unknown option that DeepSpeed's launcher takes (`zerollm train ... --hostfile h`)
    is refused saying where such options go."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        theirs = sorted({word.partition("=")[0] for word in unknown} & DEEPSPEED_LAUNCHER_OPTIONS) \
            if args.command != "launch" else []  # which has its own
        where = ("give them to `zerollm launch --hostfile FILE -- train ...` or `deepspeed --hostfile FILE --module "
                 "llm train ...`, or run ranks on this machine with --nproc N" if args.command == "train" else
                 f"zerollm {args.command} runs its ranks on this machine, with --nproc N"
                 if hasattr(args, "nproc") else f"zerollm {args.command} runs as one process")
        hint = f" ({', '.join(theirs)}: DeepSpeed's launcher's; {where})" if theirs else ""
        if args.command == "launch" and (ours := {word.partition("=")[0]: LAUNCH_SPELLINGS[word.partition("=")[0]]
                                                  for word in unknown if word.partition("=")[0] in LAUNCH_SPELLINGS}):
            hint = f" (zerollm launch spells {', '.join(f'{theirs} as {mine}' for theirs, mine in ours.items())})"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def _error_stream_to_nowhere() -> None:
    """Descriptor 2 and sys.stderr on /dev/null (the ranks a job starts inherit it too)."""
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != 2:
        os.dup2(fd, 2)
        os.close(fd)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115 - for life


def main(argv: list[str] | None = None) -> None:
    argv = attach_negative_weights(sys.argv[1:] if argv is None else argv)
    args = parse_arguments(argv)
    args.argv = argv
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    stdout = sys.stdout
    if isinstance(stdout, io.TextIOWrapper):  # what its encoding cannot write is escaped (a strict stdout raised after
        stdout.reconfigure(errors=SHOWN_ANYHOW)  # the work was done, or mid-training)
    if stdout is not None:  # None where descriptor 1 was closed at start: print() then writes nothing
        sys.stdout = GuardedStdout(stdout)
    if sys.stderr is None:  # descriptor 2 closed at start (2>&-): progress bars and input() failed on it, exit 1
        _error_stream_to_nowhere()
    try:
        _refuse_paths_libraries_cannot_open(args)
        if args.command not in WITHOUT_DEEPSPEED:
            refuse_unknown_accelerator()
        code = COMMANDS[args.command](args)
        if stdout is not None:
            sys.stdout.flush()  # what is still buffered: its failure is said here, not as an exception at exit
    except UserError as exc:
        _report(exc)
        if exc.end_at_once:
            end_now(EXIT_USER_ERROR)
        code = EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("zerollm: interrupted", file=sys.stderr)
        code = 130
    except Terminated:
        print("zerollm: stopped by SIGTERM", file=sys.stderr)
        code = EXIT_TERMINATED
    except OutputLost as lost:  # end_now, not sys.exit: a job may have run in this process
        discard(stdout)
        if isinstance(lost.error, BrokenPipeError):
            end_now(EXIT_PIPE_CLOSED)
        report(f"cannot write the output ({lost})")
        end_now(EXIT_USER_ERROR)
    except OSError as exc:
        if exc.errno not in UNUSABLE_PATH or not _given(exc.filename, argv):  # a path of the product's own: its bug
            raise
        report(f"{exc.filename}: {exc.strerror}")  # pathlib's is_file() and is_dir() raise these (ENOENT: False)
        code = EXIT_USER_ERROR
    finally:
        sys.stdout = stdout
    settle(stdout)
    sys.exit(code)


if __name__ == "__main__":  # python -m llm.cli
    main()
