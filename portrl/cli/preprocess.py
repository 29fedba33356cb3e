"""``portrl preprocess {gsm8k,math,dapo_math,arith,arith_tool,wordprob,code,qa,geo3k}``: local raw files -> verl-schema train/test parquet.

Heavy modules (pyarrow, the converters) are imported when the command runs, so that ``portrl --help`` and
``portrl preprocess --help`` stay fast.
"""

from __future__ import annotations

from portrl.outputs import add_on_existing_argument
from portrl.tasks import TASK_NAMES  # the registry imports nothing heavy: --help stays fast


def add_arguments(parser) -> None:
    parser.add_argument("task", choices=TASK_NAMES, help="dataset format of the input (arith, arith_tool, wordprob: generated, no input; "
                        "code without --input: the small problem set shipped with portrl; qa: any rows with a "
                        "question and an answer; geo3k: hiyouga/geometry3k rows with images, problem and answer, "
                        "written as verl's multimodal parquet)")
    parser.add_argument("--input", help="raw file (.jsonl/.json/.parquet/.arrow), a folder with train*/test* files, "
                        "or a folder written by datasets' save_to_disk")
    parser.add_argument("--test-input", help="raw file for the test split (else a folder's test* file or --test-fraction)")
    parser.add_argument("--output-dir", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--test-fraction", type=float, default=0.1,
                        help="share held out as test when the input has no test split (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (and of arith's problems)")
    parser.add_argument("--n", type=int, help="arith, arith_tool, wordprob: problems to generate, train + test "
                        "(default 2000); else: raw rows read per split")
    parser.add_argument("--difficulty", type=int, help="arith, arith_tool: level 1-10 (default 1); wordprob: +/- steps "
                        "after the product, 1-3 (default 1); math: highest MATH level kept (1-5)")
    parser.add_argument("--data-source", help="code: the data_source written on every row (codecontests, apps, "
                        "codeforces, taco, leetcode; default: the row's, else codecontests). qa: it picks the reward "
                        "and the default instruction: qa_boxed (default; the response's last \\boxed{} must equal the "
                        "answer: numbers, fractions, expressions, short text), openai/gsm8k (the number after "
                        "'####'), math_dapo or math (the line 'Answer: N', as verl scores 'math'), arith (the last integer, no instruction); any "
                        "other name is written as given and needs a custom reward (reward.custom.path)")
    parser.add_argument("--question-key", help="qa: the field holding the question (default: the first of question, "
                        "problem, prompt, input, query; a string or a list of chat messages)")
    parser.add_argument("--answer-key", help="qa: the field holding the answer (default: the first of answer, "
                        "solution, output, target, ground_truth); the ground truth is the number after '####', else "
                        "the last \\boxed{} content, else the answer as written")
    parser.add_argument("--instruction", help="qa: text appended to the question instead of the data source's "
                        "('' for none)")
    parser.add_argument("--system", help="qa: a system message put before the question (rows with one keep theirs)")
    parser.add_argument("--sft", action="store_true", help="arith, arith_tool, wordprob: also write "
                        "sft_train/sft_test.parquet with a response column")
    add_on_existing_argument(parser)


def run(args) -> int:
    import pyarrow.parquet as pq  # noqa: PLC0415  (CLI start-up: loaded by the command)

    from portrl.data.preprocess import preprocess  # noqa: PLC0415  (CLI start-up: loaded by the command)

    # bad input: DataError (a UserError)
    paths = preprocess(args.task, args.output_dir, input_path=args.input, test_input=args.test_input,
                       test_fraction=args.test_fraction, seed=args.seed, n=args.n, difficulty=args.difficulty,
                       sft=args.sft, data_source=args.data_source, question_key=args.question_key,
                       answer_key=args.answer_key, instruction=args.instruction, system=args.system,
                       on_existing=args.on_existing)
    for name, path in paths.items():
        print(f"{name}: {pq.read_metadata(path).num_rows} rows -> {path}")
    return 0
