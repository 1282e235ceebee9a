"""The command line's errors stay whole off a terminal."""

from spmdkit._cli import main


def test_an_error_off_a_terminal_keeps_a_long_path_on_one_line(tmp_path, capsys):
    deep = tmp_path / ("d" * 90) / ("e" * 90)
    deep.mkdir(parents=True)
    code = main(["plan", "--task", "mlp", "--devices", "8", "--target", "h100x8", "--json", str(deep)])
    err = capsys.readouterr().err
    assert code == 5
    line = next(l for l in err.splitlines() if l.startswith("error:"))
    assert f"--json '{deep}' is a directory." in line, err
