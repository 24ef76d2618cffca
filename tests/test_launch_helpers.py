"""The test launcher's result parser: ranks share one pipe, so a rank's ``RESULT {json}`` can
land after another rank's unfinished line, or two results can share a line."""

from launch import parse_results


def test_a_result_after_another_ranks_unfinished_line_is_found():
    out = ('iteration 11/12 | loss 3.2RESULT {"rank": 0, "count": 5}\n'
           'RESULT {"rank": 1, "count": 5}RESULT {"rank": 2, "count": 5}\n\n'
           '  RESULT {"rank": 3, "count": 5}\n')
    assert [r["rank"] for r in parse_results(out)] == [0, 1, 2, 3]


def test_the_prefix_in_plain_text_is_not_a_result():
    out = 'print("RESULT " + json.dumps(x))\nRESULT {"rank": 0}\nPACI_SUMMARY {"a": [1]}\n'
    assert parse_results(out) == [{"rank": 0}]
    assert parse_results(out, prefix="PACI_SUMMARY ") == [{"a": [1]}]
