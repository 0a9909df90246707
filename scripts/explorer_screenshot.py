"""The README's explorer screenshot (docs/img/explorer.png), taken with headless Chromium.

    python scripts/explorer_screenshot.py [--out docs/img/explorer.png] [--page explorer.html]

The held-out benchmark line, layer and head where the bundled DCPythia's
composition changes attention most (synth_tasks.composition.most_composed, as
`make demo` picks for its heatmaps), its page with the MHA twin and IG of the
answer's log-probability per head, opened at that head and query.
"""

import argparse
import os
import sys
import tempfile

import dclens
from synth_tasks.composition import most_composed
from synth_tasks.corpus import HELDOUT_FILE
from synth_tasks.dataset import load_dataset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/img/explorer.png")
    ap.add_argument("--page", default=None, help="also keep the HTML page here")
    ap.add_argument("--size", default="1400,1240", help="window width,height in pixels")
    a = ap.parse_args(argv)
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    model, twin = dclens.load("dcpythia-tiny"), dclens.load("pythia-tiny")
    pick = most_composed(model, load_dataset(HELDOUT_FILE, limit=74).lines)
    toks = model.to_tokens(pick["text"])
    q = pick["query_position"]
    ex = dclens.explore(model, toks, twin=twin, attribution=("logprob", q, int(toks[q + 1])))
    page = a.page or os.path.join(tempfile.mkdtemp(), "explorer.html")
    ex.save(page)
    print(
        "line %s of %s, layer %d head %d, query %d; page %d bytes"
        % (pick["line"], pick["task_id"], pick["layer"], pick["head"], q, len(ex))
    )

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=" + a.size, "--hide-scrollbars"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get(
            "file://%s#layer=%d&head=%d&query=%d&view=pattern_composed"
            % (os.path.abspath(page), pick["layer"], pick["head"], q)
        )
        WebDriverWait(d, 30).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        d.save_screenshot(a.out)
    finally:
        d.quit()
    Image.open(a.out).convert("RGB").quantize(256).save(a.out, optimize=True)  # a small PNG for the repository
    print("wrote %s (%d bytes)" % (a.out, os.path.getsize(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
