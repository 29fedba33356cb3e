"""``portrl preprocess {gsm8k,math,dapo_math,arith,code}``: local raw files -> verl-schema train/test parquet.

Heavy modules (pyarrow, the converters) are imported when the command runs, so that ``portrl --help`` and
``portrl preprocess --help`` stay fast.
"""

from __future__ import annotations

# as portrl.data.preprocess.TASKS (not imported: --help stays fast)
TASKS = ("gsm8k", "math", "dapo_math", "arith", "code")


def add_arguments(parser) -> None:
    parser.add_argument("task", choices=TASKS, help="dataset format of the input (arith: generated, no input; "
                        "code without --input: the small problem set shipped with portrl)")
    parser.add_argument("--input", help="raw file (.jsonl/.json/.parquet) or a folder with train*/test* files")
    parser.add_argument("--test-input", help="raw file for the test split (else a folder's test* file or --test-fraction)")
    parser.add_argument("--output-dir", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--test-fraction", type=float, default=0.1,
                        help="share held out as test when the input has no test split (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (and of arith's problems)")
    parser.add_argument("--n", type=int, help="arith: problems to generate, train + test (default 2000); else: raw rows read per split")
    parser.add_argument("--difficulty", type=int, help="arith: level 1-10 (default 1); math: highest MATH level kept (1-5)")
    parser.add_argument("--data-source", help="code: the data_source written on every row (codecontests, apps, "
                        "codeforces, taco, leetcode; default: the row's, else codecontests)")
    parser.add_argument("--sft", action="store_true", help="arith: also write sft_train/sft_test.parquet with a response column")


def run(args) -> int:
    import pyarrow.parquet as pq

    from portrl.data.preprocess import preprocess

    paths = preprocess(args.task, args.output_dir, input_path=args.input, test_input=args.test_input,
                       test_fraction=args.test_fraction, seed=args.seed, n=args.n, difficulty=args.difficulty,
                       sft=args.sft, data_source=args.data_source)  # bad input: DataError (a UserError)
    for name, path in paths.items():
        print(f"{name}: {pq.read_metadata(path).num_rows} rows -> {path}")
    return 0
