"""One line that says what went wrong in code that is not ours (a tool, an environment, a reward
function): what a session replies, what a reward result carries, what the log shows."""


def describe_exception(error: BaseException, limit: int = 500) -> str:
    """"ExcType: first line of the message", at most `limit` characters (one log line)."""
    lines = str(error).strip().splitlines()
    message = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return message if len(message) <= limit else message[:limit - 3] + "..."
