"""`msinfer bench`: placeholder until the benchmark lands (issue 7)."""


def add_bench_parser(sub) -> None:
    pass
