"""Command line: ``python -m semzo {run,experiment,check,topology,corpus,inspect,export,
convert,generate,deck-doc} ...``.

Every command is SPMD-safe: launched under ``mpirun -n N`` each rank runs it, rank 0 prints,
and an error on any rank ends every rank (see :func:`semzo.runtime.run_spmd`).
"""

from __future__ import annotations

import argparse
import sys

from .deckdoc import markdown
from .runtime import EXIT_USAGE, SemzoError, _rank_size, run_spmd, setup_logging


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="semzo", description="Semantic sharding and zeroth-order fine-tuning "
                "of transformers over MPI. Launch with mpirun/srun for parallel runs.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run the pipeline stages of a deck")
    r.add_argument("deck")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a deck key (repeatable); validated like the deck")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint (same as --set "
                   "checkpoint.resume=auto)")
    x = sub.add_parser("experiment", help="compare semantic, shuffled and random sharding "
                       "across ZO modes and seeds at one forward-pass budget; writes report.md "
                       "and plots")
    x.add_argument("deck")
    x.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a deck key (repeatable)")
    x.add_argument("--resume", action="store_true",
                   help="keep the stages and configurations an interrupted run of the same "
                   "deck completed in run.output_dir, run the rest")
    x.add_argument("--report-only", action="store_true",
                   help="rebuild report.md and the plots from a finished experiment's files")
    c = sub.add_parser("check", help="validate a deck and print it resolved")
    c.add_argument("deck")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    t = sub.add_parser("topology", help="print the rank/node/switch hierarchy a run would use")
    t.add_argument("deck", nargs="?")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    k = sub.add_parser("corpus", help="write a JSONL corpus from a system source")
    k.add_argument("source", choices=("fortunes", "debian", "debian-sft",
                                            "debian-choice"))
    k.add_argument("out")
    i = sub.add_parser("inspect", help="summarize and verify a checkpoint (file or folder)")
    i.add_argument("ckpt")
    i.add_argument("--no-deck", action="store_true", help="do not print the stored deck")
    e = sub.add_parser("export", help="write a checkpoint's model as a Hugging Face folder "
                       "or a GGUF file")
    e.add_argument("ckpt", help="checkpoint file, or folder (its newest valid checkpoint); "
                   "with --format gguf also a model folder or a named model")
    e.add_argument("outdir", help="folder (hf) or file (gguf) to write")
    e.add_argument("--format", choices=("hf", "gguf"), default="hf",
                   help="hf: Hugging Face folder (default); gguf: one GGUF file for "
                   "llama.cpp / Ollama (llama, mistral, qwen2, qwen3, gemma2 and gemma3 models, "
                   "tokenizer included)")
    e.add_argument("--gguf-type", choices=("f32", "f16", "bf16", "q8_0"), default="f32",
                   help="GGUF tensor type of the matrices (norms stay f32; default f32)")
    e.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weight dtype in model.safetensors (default: the stored one)")
    e.add_argument("--force", action="store_true", help="overwrite a non-empty outdir")
    v = sub.add_parser("convert", help="convert a model file into a Hugging Face folder "
                       "(GGUF: config.json, model.safetensors, tokenizer.json)")
    v.add_argument("format", choices=("gguf",))
    v.add_argument("src", help="input file (.gguf)")
    v.add_argument("outdir", help="folder to create (written atomically)")
    v.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="weight dtype in model.safetensors (default float32)")
    v.add_argument("--force", action="store_true", help="replace an existing outdir")
    g = sub.add_parser("generate", help="generate text with a decoder: a Hugging Face folder, "
                       "a named model (smollm2), a GGUF file or a semzo checkpoint")
    g.add_argument("model", metavar="MODEL_OR_CHECKPOINT")
    g.add_argument("--prompt", required=True, action="append",
                   help="the prompt; repeat for several (printed as JSON lines, "
                        "generated --batch at a time)")
    g.add_argument("--batch", type=int, default=8,
                   help="prompts generated together in one KV cache (default 8): each "
                        "step reads the weights once for all of them")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="weight storage: float32 (default) or bfloat16 (half the memory; float32 "
                        "arithmetic unless --matmul bfloat16); a checkpoint uses the dtype it "
                        "was trained with")
    g.add_argument("--matmul", choices=("float32", "bfloat16"), default=None,
                   help="the GEMMs' arithmetic: float32 (default) or bfloat16 (bfloat16 "
                        "inputs, float32 sums; needs bfloat16 weights; the CPU's "
                        "AMX tiles or AVX512_BF16 dot products where it has them); a "
                        "checkpoint uses the "
                        "model.matmul of its deck")
    g.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="where the forward passes run: cpu (default) or gpu (the first "
                        "visible GPU, CuPy)")
    g.add_argument("--chat", action="store_true",
                   help="render the prompt as a user message with the model's chat template")
    g.add_argument("--chat-var", action="append", default=[], metavar="KEY=VALUE",
                   help="with --chat: a variable for the template, as transformers' "
                        "apply_chat_template(KEY=VALUE) (VALUE as JSON when it parses, "
                        "else a string), e.g. enable_thinking=false for Qwen3; repeatable")
    sub.add_parser("deck-doc", help="print the deck reference (docs/deck.md)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    run_spmd(lambda: _dispatch(args))


def _dispatch(args: argparse.Namespace) -> int:
    # Each command imports what it runs inside its branch: importing mpi4py starts MPI, which
    # `semzo convert`, `corpus` and `deck-doc` must not do, and the pipeline's modules pull in
    # numba, h5py and every stage (seconds that `semzo --help` or `check` should not pay).
    if args.cmd == "deck-doc":
        print(markdown())
        return 0
    if args.cmd == "corpus":
        return _corpus(args)
    if args.cmd == "convert":
        return _convert(args)
    if args.cmd == "generate":
        from .generate import run_generate

        print(run_generate(args))
        return 0
    if args.cmd in ("inspect", "export"):
        return _checkpoint_tool(args)

    from mpi4py import MPI

    from .pipeline import load_deck_collective

    comm = MPI.COMM_WORLD
    if getattr(args, "resume", False) and args.cmd == "run":
        args.set = [*args.set, "checkpoint.resume=auto"]
    # `topology` only needs the [topology] section: input files need not exist yet
    report_only = getattr(args, "report_only", False)
    deck = load_deck_collective(args.deck, args.set, comm,
                                check_inputs=args.cmd != "topology" and not report_only,
                                check_world=not report_only and not (
                                    args.cmd == "check" and comm.Get_size() == 1))
    setup_logging(deck.run.log_level)
    if args.cmd == "check":
        if comm.Get_rank() == 0:
            print(deck.to_toml(), end="")
        return 0
    if args.cmd == "topology":
        from .topology import build_topology

        topo = build_topology(comm, deck.topology, src=deck.source)
        if topo.rank == 0:
            print(topo.describe())
        topo.free()
        return 0
    if args.cmd == "experiment":
        return _experiment(deck, comm, report_only, args.resume)
    from .pipeline import run

    run(deck, comm)
    return 0


def _experiment(deck, comm, report_only: bool, resume: bool) -> int:
    from .experiment import run_experiment, write_report

    if not report_only:
        path = run_experiment(deck, comm, resume=resume)
    elif deck.experiment.decks:
        from .experiment.tasks import index_report

        path = index_report(deck, comm)
    else:
        err, path = None, None
        if comm.Get_rank() == 0:
            try:
                path = write_report(deck.run.output_dir)
            except FileNotFoundError as exc:
                err = f"{deck.source}: run.output_dir: {exc.filename or exc}: not found " \
                      f"(run `semzo experiment` without --report-only first)"
        err, path = comm.bcast((err, path), root=0)
        if err:
            e = SemzoError(err)
            e.all_ranks = True
            raise e
    if comm.Get_rank() == 0:
        print(f"experiment report: {path}")
    return 0


def _checkpoint_tool(args: argparse.Namespace) -> int:
    """``inspect`` (exit 1 when a checksum fails) and ``export``; any number of ranks."""
    from mpi4py import MPI

    from .checkpoint import tools

    comm = MPI.COMM_WORLD
    if args.cmd == "inspect":
        text, ok = tools.summary(args.ckpt, comm, deck=not args.no_deck)
        if comm.Get_rank() == 0:
            print(text)
        return 0 if ok else 1
    rep: dict = {}
    out = tools.export(args.ckpt, args.outdir, comm, force=args.force, dtype=args.dtype,
                       report=rep, format=args.format, gguf_type=args.gguf_type)
    if comm.Get_rank() == 0 and args.format == "gguf":
        step = "" if rep.get("step") is None else f"step {rep['step']}, "
        print(f"exported {args.ckpt} to {out} (GGUF, {step}{rep.get('dtype')}; load it with "
              f"llama.cpp, or `semzo convert gguf {out} FOLDER`)")
    elif comm.Get_rank() == 0:
        print(f"exported {args.ckpt} to {out} (step {rep.get('step')}, weights "
              f"{rep.get('dtype')}; {tools.EXPORT_INFO} records the source, the task and its "
              f"prompt)")
    return 0


def _corpus(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1:
        raise SemzoError("semzo corpus runs on one process: launch it without mpirun")
    from .corpus.convert import CONVERTERS

    n = CONVERTERS[args.source](args.out)
    print(f"wrote {n} records to {args.out}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    """``semzo convert gguf IN OUTDIR``: one process, no MPI."""
    if _rank_size()[1] > 1:
        raise SemzoError("semzo convert runs on one process: launch it without mpirun")
    from .model.convert import convert_gguf

    try:
        s = convert_gguf(args.src, args.outdir, dtype=args.dtype, force=args.force)
    except SemzoError as exc:
        exc.all_ranks = True  # one process: print "error: ..." without a rank tag
        raise
    print(f"converted {args.src} to {args.outdir}: {s['tensors']} tensors, "
          f"{s['parameters']} parameters ({args.dtype}), {s['seconds']:.1f} s")
    return 0
