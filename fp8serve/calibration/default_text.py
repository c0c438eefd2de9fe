"""The built-in calibration sample, used when no --text is given.

Written for this project. It mixes narrative, explanation, dialogue, numbers,
lists and a little code, because K/V ranges depend on the kind of text: a
sample of one register alone would under-estimate the others' outliers.
Use real text from your workload (--text) for scales you ship."""

DEFAULT_CALIBRATION_TEXT = """\
The lighthouse keeper on the northern island kept two logbooks. In the first he wrote the things that the
harbour office asked for: the hour he lit the lamp, the hour he put it out, the direction and strength of the
wind, and the names of ships that passed close enough to read. In the second he wrote everything else. He wrote
about the gannets that arrived in March and left in October, about the winter when the supply boat could not
land for six weeks, and about the evening a whale surfaced so near the rocks that he could hear it breathe.
When he retired, the office collected the first book and left the second on the shelf, where the next keeper
found it and, after some hesitation, began to add to it.

A bread recipe is a small lesson in chemistry. Flour contains starch and two proteins, glutenin and gliadin,
which form gluten when they meet water and are kneaded. Yeast feeds on sugars and releases carbon dioxide, and
the gluten network traps the gas so that the dough rises. Salt slows the yeast and tightens the gluten, which
is why a loaf made without it spreads and tastes flat. In the oven, the water in the dough turns to steam,
the gas bubbles expand one last time, and the crust browns through the Maillard reaction between sugars and
amino acids. Bakers who understand these steps can rescue a dough that misbehaves instead of throwing it away.

"Are you sure this is the right train?" asked Priya, looking at the board for the third time.
"Platform nine, departing at 14:35, calling at every station to the coast," said her brother. "That's us."
"It says 14:53."
"Then we have time for coffee," he said, and walked off before she could object.

The history of timekeeping runs from shadows to atoms. Sundials divided daylight into hours that changed length
with the seasons; water clocks kept going at night and indoors; mechanical clocks with verge escapements appeared
in European towers around the year 1300. The pendulum clock, built by Christiaan Huygens in 1656, reduced the
error from about fifteen minutes a day to less than one. Marine chronometers made it possible to find longitude
at sea in the eighteenth century. Quartz oscillators took over in the twentieth century, and since 1967 the
second has been defined by the caesium atom: exactly 9,192,631,770 periods of the radiation from a particular
transition. Today the best optical clocks would neither gain nor lose a second over the age of the universe.

Quarterly results, summarised: revenue grew 7.4% year over year to $18.2 million, driven mostly by the
subscription business (+12%), while hardware sales fell 3%. Gross margin improved from 41.0% to 43.5% because
component costs eased. Operating expenses rose to $6.9 million as the company hired 23 engineers. Net income
was $1.1 million, or $0.04 per share, compared with a loss of $0.3 million a year earlier. Management expects
next quarter's revenue between $18.5 and $19.0 million.

To make a good cup of tea: boil fresh water; warm the pot; add one spoonful of leaves per person; pour the water
while it is still close to boiling for black tea, or let it cool to about 80 degrees Celsius for green tea;
steep for three to five minutes; pour through a strainer. Milk, lemon, honey and sugar are matters of taste and
of long, friendly argument.

Photosynthesis happens in two linked stages. In the light-dependent reactions, chlorophyll in the thylakoid
membranes absorbs photons, water molecules are split, oxygen is released, and the energy is stored in ATP and
NADPH. In the Calvin cycle, which takes place in the stroma, the enzyme RuBisCO fixes carbon dioxide onto a
five-carbon sugar, and the ATP and NADPH from the first stage are spent to turn the products into glucose.
RuBisCO is slow and sometimes grabs oxygen by mistake, which is why some plants, such as maize and sugar cane,
evolved ways to concentrate carbon dioxide around it.

def moving_average(values, window):
    \"\"\"Average of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result

The committee met on Tuesday to review the proposal for the new library. Members agreed that the reading room
should face north for even daylight, that the children's section needs its own entrance, and that the budget
for shelving was too low by about a fifth. Two members asked for a cafe; three opposed it on grounds of noise.
A decision was postponed until the architect returns with revised drawings in April.

Mountains shape the weather around them. When moist air is pushed up a slope it cools, its water vapour
condenses, and rain or snow falls on the windward side. By the time the air descends the far side it has lost
much of its moisture and warms as it sinks, producing the dry "rain shadow" found east of the Cascades, the
Andes and the Himalaya. The same process explains the warm, dry foehn and chinook winds that can raise the
temperature of a valley by twenty degrees in a few hours and melt a winter's snow in a day.

Q: Why does ice float?
A: Because water expands when it freezes. In ice, hydrogen bonds hold each molecule in an open hexagonal
lattice, so ice is about nine percent less dense than liquid water at zero degrees. Lakes therefore freeze from
the top down, and the layer of ice insulates the water beneath it, which is how fish survive the winter.

In 1854 a cholera outbreak killed more than five hundred people in ten days around Broad Street in London. The
physician John Snow mapped the deaths, noticed that they clustered around one public water pump, and persuaded
the local council to remove its handle. The outbreak was already waning, but his map became a founding example
of epidemiology: the idea that the pattern of a disease in space and time can reveal its cause before anyone
has seen the microbe responsible.

Grandmother's advice, as remembered by six cousins, did not agree on much. Save a little from every pay packet.
Never lend money you cannot afford to lose. Learn to swim, to cook one meal well, and to apologise properly.
Plant trees, even if you will not sit in their shade. And, according to the youngest cousin only, always carry
a spare pair of socks.
"""
