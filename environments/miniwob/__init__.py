"""MiniWoB++ web tasks in a real headless Chromium (`agentrl/MiniWoB-v0`, env.py): the task
list and suites (tasks.py), the action grammar (actions.py), the page as text (dom.py), the
browser as a contained resource (browser.py) and MiniWoB++'s page protocol (page.py). Needs
`pip install 'agentrl[browser]'` and Debian's chromium and chromium-driver."""
