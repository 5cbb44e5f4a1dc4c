"""User-facing errors: one line naming the problem and the fix; the CLI turns them into exit code 2."""


class UserError(Exception):
    """Bad input from the user (config, checkpoint, prompt). Never raised for internal bugs."""


class PipelineFailure(RuntimeError):
    """A pipeline process died, hung past its timeout, or the group could not be formed (the CLI: exit code 1)."""
