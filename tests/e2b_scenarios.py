"""The E2B conformance scenarios, one table for every SDK the suite runs.

Each name is a scenario that tests/test_e2b_sdk.py runs as `test_<name>` with the Python SDK
(sync; its async flavour has a test of its own) and tests/js/e2b/conformance.mjs runs under
the same name with the JavaScript SDK; tests/test_e2b_js.py checks that both cover exactly
this list, so a scenario added to one side and not the other fails the suite.
"""

from __future__ import annotations

SCENARIOS: dict[str, str] = {
    "create_info_list_kill": "create with metadata and a timeout, get info, list by metadata, kill; "
    "then the sandbox is not found",
    "list_pages_through_every_sandbox_once": "a list with a page limit walks every sandbox once",
    "timeout_ends_the_sandbox_and_set_timeout_moves_it": "set_timeout moves the end; past it the sandbox is gone",
    "connect_reaches_the_same_interpreter": "connect to a sandbox by id: the same interpreter state",
    "run_code_streams_to_callbacks": "stdout, stderr and the result reach their callbacks; execution counts",
    "matplotlib_png": "a matplotlib figure comes back as one PNG",
    "dataframe_html": "a DataFrame comes back as its HTML table and text",
    "an_error_comes_back_typed": "an exception comes back with name, value and traceback, and on_error",
    "state_across_calls_and_separate_contexts": "state lives across calls; contexts are separate; "
    "restart forgets; a removed context is not found",
    "env_vars_of_the_sandbox_and_of_one_call": "a sandbox's envs, and one call's envs put back after it",
    "two_sandboxes_are_isolated": "two sandboxes share no state, files or the server's environment; "
    "another tenant's sandbox is not found",
    "a_wrong_key_is_refused": "a wrong API key raises the SDK's authentication error",
    "unknown_template_lists_the_templates": "an unknown template is refused, naming the templates",
    "other_languages_name_what_is_supported": "a language other than python is refused, naming python",
    "pause_and_snapshots_say_not_supported": "without a snapshot store (no SANDBOX_SNAPSHOT_DIR) pause "
    "and snapshots answer 'not supported', naming the feature (with a store: tests/test_e2b_pause.py, "
    "tests/test_e2b_snapshots.py)",
    "a_run_code_timeout_raises_and_the_context_lives_on": "a run past its timeout raises the SDK's "
    "timeout error; the context keeps its state",
    "a_tenant_quota_applies": "a tenant over max_sessions gets the SDK's rate-limit error",
    "calls_on_one_context_take_turns_and_keep_their_env_vars": "concurrent calls on one context take "
    "turns, each with its own envs",
    "files_round_trip": "files written (text, bytes, several at once) and read back, listed with depth, "
    "made, renamed, removed; what run_code wrote reads through files and the other way round; "
    "a watch sees run_code's file; a path outside /home/user is refused",
    "commands_foreground_background_stdin_kill": "a command's output reaches its callbacks; a failing "
    "one raises with its exit code; a background one takes stdin, is listed, and is killed",
    "a_server_in_the_sandbox_is_reached_through_get_host": "an HTTP server a command started is "
    "reached at get_host(port), with the sandbox's traffic access token",
}
