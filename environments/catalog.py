"""The built-in environments' ids, registered through the `agentrl.environments` entry-point
group like any third-party package's (agentrl loads the group when imported). Each names its
class by a "module:attr" string, so a module is imported only when its env is made."""

from agentrl.envs import register

register(
    "agentrl/Reverse-v0",
    "environments.toy.reverse:ReverseEnv",
    summary="Single-turn: reverse a short word (partial credit per letter).",
    aliases=("reverse",),
)
register(
    "agentrl/GuessNumber-v0",
    "environments.toy.guess:GuessNumberEnv",
    summary="Multi-turn: guess a number in [1, 16] from higher/lower hints (reward 1 if found).",
    aliases=("guess-number",),
)
register(
    "agentrl/GridWalk-v0",
    "environments.toy.grid:GridWalkEnv",
    summary="Multi-turn: walk a 4x4 grid to its goal around holes (states recur; for GiGPO).",
    aliases=("grid-walk",),
)
register(
    "agentrl/Digits-v0",
    "environments.toy.digits:DigitsEnv",
    summary="Answer in digits only; reward = digit fraction per turn (tiny-model learning task).",
    aliases=("digits",),
)
register(
    "agentrl/MathTIR-v0",
    "environments.math_tir.env:MathTIREnv",
    summary="Multi-turn tool-integrated math: write Python, see its output, answer in \\boxed{}.",
    aliases=("math-tir",),
)
register(
    "agentrl/Math-v0",
    "environments.math_tir.env:MathEnv",
    summary="Single-turn math: answer in \\boxed{}, graded with math-verify.",
    aliases=("math",),
)
register(
    "agentrl/ScreenClick-v0",
    "environments.screenshot.click:ScreenClickEnv",
    summary="Screenshots (VLM): click the red square on 3 screens; image-blind ceiling 1/16.",
    aliases=("screen-click",),
)
register(
    "agentrl/ScreenForm-v0",
    "environments.screenshot.form:ScreenFormEnv",
    summary="Screenshots (VLM): read a drawn form's instructions, click fields, type, submit.",
    aliases=("screen-form",),
)
register(
    "agentrl/MiniWoB-v0",
    "environments.miniwob.env:MiniWoBEnv",
    summary="Web tasks in headless Chromium (MiniWoB++): page text or screenshots; task= a task "
            "or suite.",
    aliases=("miniwob",),
)
