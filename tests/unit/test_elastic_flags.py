"""ps-trainer's elastic flags: a mistake is one line with a hint before anything starts."""

import pytest

from trainer.running import cli


@pytest.mark.parametrize("flags,message", [
    (["--join", "--rank", "2", "--max-trainers", "3"],
     "ps-trainer: error: --rank (2) does not go with --join: the job hands a joiner the lowest free rank"),
    (["--hold-at-round", "3"], "ps-trainer: error: --hold-at-round (3) waits for a membership change: give "
                               "--max-trainers K"),
    (["--hold-at-round", "-1", "--max-trainers", "2"], "ps-trainer: error: --hold-at-round (-1) must be zero"),
])
def test_a_bad_elastic_flag_is_one_line_with_a_hint_before_starting_anything(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.run_cli("ps-trainer", lambda: cli.main(["--ps", "127.0.0.1:1", *flags]))
    err = capsys.readouterr().err
    assert e.value.code == 1 and message in err and "Traceback" not in err
    assert "hint:" in err and len(err.strip().splitlines()) == 2  # the cause, then the hint


def test_a_joiner_without_rank_is_accepted_and_its_rank_comes_from_the_job():
    args = cli.build_parser().parse_args(["--ps", "127.0.0.1:1", "--join", "--max-trainers", "3"])
    cfg = cli.config_from_args(args, env={})
    assert cfg.join and cfg.rank == 0  # a placeholder: trainer.running.loop.train takes the rank the job hands out
