/* pagedtrace annotated-source page: step selector and per-line value panel.
 *
 * Reads the JSON in <script id="pt-data" type="application/json">:
 *   {steps: [int], kinds: [str], default: int|null, texts: [[text, kind]], pages: [step page or ""],
 *    anchors: [{key, label, line, preamble?, value?: textIndex, steps?: [textIndex per step]}]}
 * A line shows the value alone; its label and preamble are said once, in the panel.
 * The URL hash selects a line and/or a step: #line-123, #step-4, #line-123,step-4.
 * Everything is written with textContent: no value is ever parsed as HTML.
 */
(function () {
  "use strict";
  var dataEl = document.getElementById("pt-data");
  if (!dataEl) { return; }
  var data = JSON.parse(dataEl.textContent);
  var select = document.getElementById("pt-step");
  var panel = document.getElementById("pt-panel-body");
  var byLine = {};
  var byKey = {};
  data.anchors.forEach(function (a) {
    (byLine[a.line] = byLine[a.line] || []).push(a);
    byKey[a.key] = a;
  });
  var current = data.steps.indexOf(data["default"]);
  var selectedLine = null;
  var clicked = false;

  function valueAt(anchor, i) {
    var idx = ("value" in anchor) ? anchor.value : (i >= 0 ? anchor.steps[i] : -1);
    return idx >= 0 ? data.texts[idx] : null;
  }

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) { node.className = cls; }
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  function renderNotes() {
    var notes = document.querySelectorAll(".note[data-anchor]");
    for (var n = 0; n < notes.length; n++) {
      var note = notes[n];
      var anchor = byKey[note.getAttribute("data-anchor")];
      if (!anchor) { continue; }
      var value = valueAt(anchor, current);
      var text = value ? value[0] : "";
      note.textContent = text;
      note.title = anchor.label + (anchor.preamble ? " (" + anchor.preamble + ")" : "") + ": " + text;
      note.className = "note k-" + (value ? value[1] : "static");
    }
    renderStepLink();
  }

  function renderStepLink() {
    var box = document.getElementById("pt-step-page");
    if (!box || current < 0 || !data.pages) { return; }
    while (box.firstChild) { box.removeChild(box.firstChild); }
    var label = "step " + data.steps[current];
    if (data.pages[current]) {
      var link = el("a", "", label + ": block table, slots, verdicts");
      link.href = data.pages[current];
      box.appendChild(link);
    } else {
      box.appendChild(el("span", "muted", label + " has no step page"));
    }
  }

  function stepLabel(i) {
    return "step " + data.steps[i] + " (" + data.kinds[i] + ")";
  }

  function renderAnchor(anchor) {
    var box = el("div", "anchor");
    box.appendChild(el("h3", "", anchor.label + "  (line " + anchor.line + ")"));
    if (anchor.preamble) { box.appendChild(el("p", "preamble k-computed", anchor.preamble)); }
    var table = el("table");
    if ("value" in anchor) {
      var value = valueAt(anchor, -1);
      var row = el("tr");
      row.appendChild(el("th", "", "every step"));
      row.appendChild(el("td", "val k-" + value[1], value[0]));
      table.appendChild(row);
    } else {
      /* One row per run of consecutive steps with the same value. */
      var i = 0;
      while (i < data.steps.length) {
        var j = i;
        while (j + 1 < data.steps.length && anchor.steps[j + 1] === anchor.steps[i]) { j++; }
        var v = valueAt(anchor, i);
        var tr = el("tr", current >= i && current <= j ? "current" : "");
        tr.appendChild(el("th", "", i === j ? stepLabel(i) : "steps " + data.steps[i] + "-" + data.steps[j] + " (" + (j - i + 1) + ")"));
        tr.appendChild(el("td", "val k-" + (v ? v[1] : "static"), v ? v[0] : "(no value)"));
        table.appendChild(tr);
        i = j + 1;
      }
    }
    box.appendChild(table);
    return box;
  }

  function renderPanel() {
    while (panel.firstChild) { panel.removeChild(panel.firstChild); }
    if (selectedLine === null) {
      panel.appendChild(el("p", "muted", "Click a marked line to see its value at every step."));
      return;
    }
    var anchors = byLine[selectedLine] || [];
    if (!anchors.length) {
      panel.appendChild(el("p", "muted", "Line " + selectedLine + ": no traced value on this line."));
      return;
    }
    anchors.forEach(function (a) { panel.appendChild(renderAnchor(a)); });
  }

  function selectLine(line) {
    var old = document.querySelector(".code .l.sel");
    if (old) { old.classList.remove("sel"); }
    selectedLine = line;
    var row = line === null ? null : document.getElementById("line-" + line);
    if (row) { row.classList.add("sel"); }
    renderPanel();
  }

  function applyHash() {
    var hash = window.location.hash.slice(1);
    var step = /(?:^|,)step-(\d+)/.exec(hash);
    if (step) {
      var i = data.steps.indexOf(parseInt(step[1], 10));
      if (i >= 0) { current = i; if (select) { select.selectedIndex = i; } }
    }
    var line = /(?:^|,)line-(\d+)/.exec(hash);
    if (line) {
      var number = parseInt(line[1], 10);
      selectLine(number);
      var row = document.getElementById("line-" + number);
      if (row && step && !clicked) { row.scrollIntoView({block: "center"}); }
    }
    clicked = false;
    renderNotes();
    renderPanel();
  }

  if (select) {
    select.addEventListener("change", function () {
      current = select.selectedIndex;
      /* The hash names the step (and line), so the view can be linked to; applyHash redraws. */
      var hash = (selectedLine !== null ? "line-" + selectedLine + "," : "") + "step-" + data.steps[current];
      if (window.location.hash.slice(1) === hash) { renderNotes(); renderPanel(); } else { window.location.hash = hash; }
    });
  }
  var code = document.getElementById("code");
  if (code) {
    code.addEventListener("click", function (event) {
      var row = event.target.closest(".l");
      if (!row || event.target.closest("a")) { return; }
      /* Keep the step in the hash; a click does not scroll (the line is where the reader looks). */
      clicked = true;
      window.location.hash = row.id + (current >= 0 ? ",step-" + data.steps[current] : "");
    });
  }
  window.addEventListener("hashchange", applyHash);
  applyHash();
}());
