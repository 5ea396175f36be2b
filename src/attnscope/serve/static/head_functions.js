/* attnscope explorer: the Head functions tab's drawings.
 *
 * drawGrid(box, scores, column, onClick): a layers x heads grid (0-indexed; a layer down, a head across) of one
 * column of POST /api/head-scores' answer (HeadScores.to_dict: `heads` rows with layer, head, window and every
 * score column), each cell coloured by its value; a sliding-window layer's label carries its window (wN).
 * drawTrial(box, trial): POST /api/head-trial's answer: the trial's tokens, each shaded by the head's attention
 * from the query (outlined), the keys the score reads marked. Values come from the server; nothing is computed
 * here beyond the colour scale.
 */
(function () {
  "use strict";

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* The colour range of a column: 0..1 when every value lies there (shares), else its own min..max. */
  function range(values) {
    const finite = values.filter((v) => v !== null && Number.isFinite(v));
    if (!finite.length || finite.every((v) => v >= 0 && v <= 1)) return [0, 1];
    const low = Math.min(...finite);
    const high = Math.max(...finite);
    return [low, high > low ? high : low + 1];
  }

  function shade(value, low, high) {
    if (value === null || !Number.isFinite(value)) return "#e6e6e6";
    const t = Math.max(0, Math.min(1, (value - low) / (high - low)));
    return `rgba(33, 102, 172, ${(0.05 + 0.95 * t).toFixed(3)})`;
  }

  function format(value) {
    return value === null || !Number.isFinite(value) ? "n/a" : value.toFixed(3);
  }

  function drawGrid(box, scores, column, onClick) {
    const [layers, heads] = scores.shape;
    const values = scores.heads.map((row) => row[column]);
    const [low, high] = range(values);
    const grid = el("div", "ex-grid hf-grid");
    grid.style.gridTemplateColumns = `64px repeat(${heads}, minmax(22px, 1fr))`;
    const cells = [el("span", "ex-axis", "")];
    for (let h = 0; h < heads; h++) cells.push(el("span", "ex-axis", `h${h}`));
    for (let layer = 0; layer < layers; layer++) {
      const window = scores.windows.length ? scores.windows[layer] : 0;
      const label = el("span", window ? "ex-axis hf-windowed" : "ex-axis", window ? `L${layer} w${window}` : `L${layer}`);
      if (window) label.title = `a sliding-window layer: no key beyond the last ${window} is seen`;
      cells.push(label);
      for (let head = 0; head < heads; head++) {
        const row = scores.heads[layer * heads + head];
        const cell = el("button", "ex-cell hf-cell", "");
        cell.type = "button";
        cell.dataset.layer = String(layer);
        cell.dataset.head = String(head);
        cell.dataset.value = String(row[column]);
        cell.style.background = shade(row[column], low, high);
        cell.title = `layer ${layer}, head ${head} (KV head ${row.kv_head}): ${column} ${format(row[column])}` +
          (row.note ? `; ${row.note}` : "");
        cell.addEventListener("click", () => onClick(layer, head));
        cells.push(cell);
      }
    }
    grid.replaceChildren(...cells);
    const scale = el("p", "ex-note", `${column}: light ${format(low)} to dark ${format(high)}; grey: not defined (NaN). ` +
      "Layers and heads 0-indexed; wN: a sliding-window layer of N keys.");
    box.replaceChildren(grid, scale);
  }

  function open(box, layer, head) {
    for (const cell of box.querySelectorAll(".hf-cell")) {
      cell.classList.toggle("ex-open", +cell.dataset.layer === layer && +cell.dataset.head === head);
    }
  }

  function drawTrial(box, trial) {
    const top = Math.max(...trial.row, 1e-9);
    const marked = new Set(trial.marked);
    const tokens = el("div", "ex-tokens hf-tokens");
    trial.tokens.forEach((token, position) => {
      const span = el("span", "", token);
      span.dataset.position = String(position);
      if (position <= trial.query) {
        const weight = trial.row[position];
        span.dataset.role = "key";
        span.dataset.weight = String(weight);
        span.style.background = `rgba(33, 102, 172, ${(weight / top).toFixed(3)})`;
        if (weight / top > 0.6) span.style.color = "#fff";
        span.title = `position ${position}: attention ${weight.toFixed(4)}`;
      }
      if (marked.has(position)) span.classList.add("hf-marked");
      if (position === trial.query) span.classList.add("hf-query");
      tokens.append(span);
    });
    box.replaceChildren(
      el("h3", "", `layer ${trial.layer}, head ${trial.head}: its attention from the outlined query (position ${trial.query})`),
      el("p", "ex-note", `${trial.note}. Marked keys hold ${trial.marked_share.toFixed(3)} of the row.`),
      tokens);
  }

  window.AttnscopeHeadFunctions = { drawGrid, drawTrial, open };
})();
