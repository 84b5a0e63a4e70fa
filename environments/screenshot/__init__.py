"""Multi-turn screenshot environments for vision-language agents, drawn with PIL (no browser,
no display): `agentrl/ScreenClick-v0` (what to click is only in the image) and
`agentrl/ScreenForm-v0` (read a form's instructions on screen, fill it in over several steps)."""
