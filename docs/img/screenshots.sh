#!/usr/bin/env sh
# Regenerates the README pictures in docs/img/ with attnscope's own commands: `attnscope view`
# writes the views for the demo sentence pair, headless Debian chromium photographs each view
# (the page address picks the view: views.html#view=neuron&layer=2&head=3&query=5), and
# `attnscope plot` draws the static figures. Run from anywhere: sh docs/img/screenshots.sh
set -eu
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
CHROMIUM=${ATTNSCOPE_CHROMIUM:-/usr/bin/chromium}  # the same override as attnscope.browser
OUT=docs/img
TEXT="I went to the store."
PAIR="At the store, I bought fresh strawberries."
PAGE=$(mktemp -d)/views.html

"$BIN/attnscope" view "$TEXT" --pair "$PAIR" --kind all -o "$PAGE"

shot() {  # shot NAME WIDTH,HEIGHT ADDRESS-FRAGMENT
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
    --disable-sync --no-first-run --hide-scrollbars --virtual-time-budget=5000 --window-size="$2" \
    --screenshot="$OUT/$1.png" "file://$PAGE#$3" 2>/dev/null
  echo "wrote $OUT/$1.png"
}
shot head_view 760,600 "view=head&layer=2"
shot model_view 1080,730 "view=model"
shot neuron_view 1130,580 "view=neuron&layer=2&head=3&query=5"

# a context-mixing measure in the head view: ALTI's rollout through the last layer (one text: no pair)
PAGE=$(mktemp -d)/mixing.html
"$BIN/attnscope" view "$PAIR" --kind head --measure alti --measure value_zeroing -o "$PAGE" >/dev/null
shot head_view_alti 760,600 "view=head&layer=5&measure=alti&rollout=1"

"$BIN/attnscope" plot "$TEXT" --pair "$PAIR" --layer 2 --head 0 -o "$OUT/plot_head.png"
"$BIN/attnscope" plot "$TEXT" --pair "$PAIR" --figure types -o "$OUT/plot_types.png"

# the step view: a decoder generating (SmolLM2) and the toy translator, the address picks the step
STEPS=$(mktemp -d)
"$BIN/attnscope" generate "Write one sentence about the sea." --chat -n 24 --html "$STEPS/generate.html" >/dev/null
"$BIN/attnscope" toy translate "i can eat apples" --html "$STEPS/toy.html" >/dev/null
PAGE=$STEPS/generate.html
shot generate_steps 1100,380 "step=9&layer=3"
PAGE=$STEPS/toy.html
shot lab_steps 1000,330 "step=2"

# the step view's attribution (generate --lens: the attribution and the lens): the heads that pushed step 0's token up or down, the
# tokens the strongest one pushed through, and the logit lens
"$BIN/attnscope" generate --model smollm2 "The capital of France is" -n 4 --lens --html "$STEPS/attribute.html" >/dev/null
PAGE=$STEPS/attribute.html
shot steps_attribution 1100,730 "step=0"

# the long view of a whole document: Gemma 3 over its whole 32,768-token window of the longest shipped
# address (the capture takes tens of minutes on 2 cores)
PAGE=$(mktemp -d)/long.html
"$BIN/attnscope" view --model gemma3 --file sotu-1981-jimmy-carter --long -o "$PAGE" >/dev/null
shot long_view_gemma3 1200,1000 "layer=5&head=0"
