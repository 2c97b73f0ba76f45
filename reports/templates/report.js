/* pagedtrace annotated-source page: step selector and per-line value panel.
 *
 * Reads the JSON in <script id="pt-data" type="application/json">:
 *   {steps: [int], kinds: [str], default: int|null, texts: [[text, kind]],
 *    anchors: [{key, label, line, value?: textIndex, steps?: [textIndex per step]}]}
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
      var text = anchor.label + ": " + (value ? value[0] : "");
      note.textContent = text;
      note.title = text;
      note.className = "note k-" + (value ? value[1] : "static");
    }
  }

  function stepLabel(i) {
    return "step " + data.steps[i] + " (" + data.kinds[i] + ")";
  }

  function renderAnchor(anchor) {
    var box = el("div", "anchor");
    box.appendChild(el("h3", "", anchor.label + "  (line " + anchor.line + ")"));
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
      if (row && step) { row.scrollIntoView({block: "center"}); }
    }
    renderNotes();
    renderPanel();
  }

  if (select) {
    select.addEventListener("change", function () {
      current = select.selectedIndex;
      renderNotes();
      renderPanel();
    });
  }
  var code = document.getElementById("code");
  if (code) {
    code.addEventListener("click", function (event) {
      var row = event.target.closest(".l");
      if (!row || event.target.closest("a")) { return; }
      window.location.hash = row.id;
    });
  }
  window.addEventListener("hashchange", applyHash);
  applyHash();
}());
